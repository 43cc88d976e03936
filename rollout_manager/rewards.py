"""Reward dispatch: one built-in, remote or custom reward function, applied safely.

An exception or a non-finite value from the reward function marks that sample ``failed`` (the
reason goes to ``sample.metadata["failure_reason"]`` and is counted); no other sample is lost.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import math
from typing import Any, Callable

from buffer.sample import Sample, Status
from plugins.loader import load_function
from plugins.rewards import BUILTIN_RMS, remote_rm
from rollout_manager.settings import PluginSettings

log = logging.getLogger(__name__)


def mark_failed(sample: Sample, reason: str) -> None:
    """Set ``status=failed`` and record why (the summary counts failures by reason)."""
    sample.status = Status.FAILED
    sample.reward = None
    sample.metadata["failure_reason"] = reason


def _check_value(value: Any, reward_key: str | None) -> float | dict[str, float]:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out[k] = _check_value(v, None)
        if reward_key is not None and reward_key not in out:
            raise ValueError(f"reward dict {sorted(out)} lacks --reward-key {reward_key!r}")
        return out
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"reward must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"reward is not finite: {value}")
    return float(value)


class Rewarder:
    """Scores samples with the reward chosen by ``--custom-rm-path``, ``--rm-url`` or ``--rm-type``."""

    def __init__(self, settings: PluginSettings, args: argparse.Namespace):
        self.args, self.group_rm, self.reward_key = args, settings.group_rm, settings.reward_key
        if settings.custom_rm_path:
            params = ["args", "samples"] if settings.group_rm else ["args", "sample"]
            self.fn: Callable = load_function(settings.custom_rm_path, "--custom-rm-path", params=params,
                                              is_async=None if settings.group_rm else True)
        elif settings.rm_url:
            self.fn = remote_rm
        else:
            self.fn = BUILTIN_RMS[settings.rm_type]

    async def score(self, sample: Sample) -> None:
        """Set ``sample.reward`` (per-sample reward functions); failures mark the sample failed."""
        try:
            sample.reward = _check_value(await self.fn(self.args, sample), self.reward_key)
        except Exception as e:  # the user's reward code: any error fails this one sample, counted
            log.warning("reward failed for sample %s: %s: %s", sample.index, type(e).__name__, e)
            mark_failed(sample, f"reward: {type(e).__name__}")

    async def score_group(self, samples: list[Sample]) -> None:
        """Score the scorable samples of a group (one batched call with ``--group-rm``)."""
        todo = [s for s in samples if s.status in (Status.COMPLETED, Status.TRUNCATED)]
        if not todo:
            return
        if not self.group_rm:
            for s in todo:
                await self.score(s)
            return
        try:
            values = self.fn(self.args, todo)
            if inspect.isawaitable(values):
                values = await values
            if not isinstance(values, (list, tuple)) or len(values) != len(todo):
                raise ValueError(f"--group-rm function returned {type(values).__name__} of "
                                 f"{len(values) if isinstance(values, (list, tuple)) else '?'} values "
                                 f"for {len(todo)} samples")
        except Exception as e:  # a failed batched call fails every sample it was scoring
            log.warning("group reward failed for group %s: %s: %s", todo[0].group_index, type(e).__name__, e)
            for s in todo:
                mark_failed(s, f"reward: {type(e).__name__}")
            return
        for s, v in zip(todo, values):
            try:
                s.reward = _check_value(v, self.reward_key)
            except (TypeError, ValueError) as e:
                mark_failed(s, f"reward: {type(e).__name__}")
