"""``slime.rollout.filter_hub.base_types``: ``DynamicFilterOutput`` and slime's helpers around it.

The rollout reads a filter's ``DynamicFilterOutput`` field by field (it is never truth-tested):
``keep``; ``reason`` (a dropped group is counted under ``rollout/dynamic_filter/drop_<reason>``);
``keep_when_insufficient`` (a rejected group is kept when dropping it would leave too few
candidates to fill the batch, instead of starting another round of prompts).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def should_drop_dynamic_filter_output(output: DynamicFilterOutput, *, remaining_batch_size: int,
                                      target_data_size: int) -> bool:
    """Whether to drop the group (``remaining_batch_size``: candidates kept or in flight, this one included)."""
    if output.keep:
        return False
    return not (output.keep_when_insufficient and remaining_batch_size <= target_data_size)


def call_dynamic_filter(fn: Callable | None, *args: Any, **kwargs: Any) -> DynamicFilterOutput:
    """Call a filter and wrap a plain bool in ``DynamicFilterOutput`` (None: keep everything)."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn(*args, **kwargs)
    if not isinstance(output, DynamicFilterOutput):
        output = DynamicFilterOutput(keep=bool(output))
    return output


class MetricGatherer:
    """Counts dropped groups by reason: ``rollout/dynamic_filter/drop_<reason>``."""

    def __init__(self) -> None:
        self._drops: Counter = Counter()

    def on_dynamic_filter_drop(self, reason: str | None) -> None:
        if reason:
            self._drops[reason] += 1

    def collect(self) -> dict[str, int]:
        return {f"rollout/dynamic_filter/drop_{r}": n for r, n in self._drops.items()}
