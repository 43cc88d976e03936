"""``slime.rollout.base_types``: what a rollout function may return.

A rollout function (``--rollout-function-path``, ``--eval-function-path``) may return a plain
list of groups, or ``RolloutFnTrainOutput(samples, metrics)`` for training and
``RolloutFnEvalOutput(data, metrics)`` for evaluation, as in slime. ``metrics`` join the step's
metrics; ``data`` maps a dataset name to ``{"rewards": [...], "truncated": [...], "samples": [...]}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from buffer.sample import Sample


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


def call_rollout_fn(fn: Callable, *args: Any, evaluation: bool,
                    **kwargs: Any) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """Call ``fn`` and wrap a plain return value in the output type (slime's helper)."""
    output = fn(*args, **kwargs, evaluation=evaluation)
    if not isinstance(output, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        output = RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)
    return output
