"""Reward dispatch: one built-in, remote or custom reward function, applied safely.

An exception or a non-finite value from the reward function marks that sample ``failed`` (the
reason goes to ``sample.metadata["failure_reason"]`` and is counted; the log names the reward's
flag, path and the sample); no other sample is lost. So does a call that runs past
``--reward-timeout`` (reason ``reward: timeout``). A reward function may be a coroutine function
(slime's form; it must not block) or a plain one, which runs in a plugin thread
(``plugin_calls.call_plugin``), so a slow or stuck reward never stalls the event loop.

A reward may be a number or a dict (slime's reward functions return e.g. ``{"score": 1.0,
"pred": "42"}``): with ``--reward-key`` the dict must hold that key with a finite number; its other
entries ride along untouched. A dict without ``--reward-key`` fails the sample with the reason
``reward: dict needs --reward-key`` (nothing downstream could read it).
"""

from __future__ import annotations

import argparse
import logging
import math
from typing import Any, Callable

from buffer.sample import Sample, Status
from plugins.loader import load_function
from plugins.rewards import BUILTIN_RMS, REMOTE_RMS, remote_rm
from rollout_manager.plugin_calls import PluginTimeout, call_plugin
from rollout_manager.settings import PluginSettings

log = logging.getLogger(__name__)


def mark_failed(sample: Sample, reason: str) -> None:
    """Set ``status=failed`` and record why (the summary counts failures by reason)."""
    sample.status = Status.FAILED
    sample.reward = None
    sample.metadata["failure_reason"] = reason


def _check_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"reward must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"reward is not finite: {value}")
    return float(value)


class DictRewardWithoutKey(ValueError):
    """A dict reward with no ``--reward-key`` to read it."""


def _check_value(value: Any, reward_key: str | None) -> float | dict[str, Any]:
    if isinstance(value, dict):
        if reward_key is None:
            raise DictRewardWithoutKey(f"reward is a dict {sorted(value)}: set --reward-key to pick one")
        if reward_key not in value:
            raise ValueError(f"reward dict {sorted(value)} lacks --reward-key {reward_key!r}")
        _check_number(value[reward_key])
        for v in value.values():  # the other numbers must be finite too (the buffer checks them all)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isfinite(v):
                raise ValueError(f"reward dict {value!r} holds a non-finite number")
        return dict(value)
    return _check_number(value)


def _reason(e: Exception) -> str:
    if isinstance(e, PluginTimeout):
        return "reward: timeout"
    return "reward: dict needs --reward-key" if isinstance(e, DictRewardWithoutKey) else f"reward: {type(e).__name__}"


class Rewarder:
    """Scores samples with the reward chosen by ``--custom-rm-path``, ``--rm-url`` or ``--rm-type``."""

    def __init__(self, settings: PluginSettings, args: argparse.Namespace):
        self.args, self.group_rm, self.reward_key = args, settings.group_rm, settings.reward_key
        self.timeout = settings.reward_timeout
        self.flag, self.path = "--rm-type", settings.rm_type
        if settings.custom_rm_path:
            self.flag, self.path = "--custom-rm-path", settings.custom_rm_path
            params = ["args", "samples"] if settings.group_rm else ["args", "sample"]
            self.fn: Callable = load_function(settings.custom_rm_path, "--custom-rm-path", params=params)
        elif settings.rm_url and settings.rm_type not in REMOTE_RMS:
            self.fn, self.flag, self.path = remote_rm, "--rm-url", settings.rm_url
        else:
            self.fn = BUILTIN_RMS[settings.rm_type]

    async def _call(self, what: Sample | list[Sample]) -> Any:
        """The reward function on one sample (or a group's, ``--group-rm``), within ``--reward-timeout``."""
        return await call_plugin(self.fn, self.args, what, timeout=self.timeout, what=f"{self.flag} {self.path}")

    async def score(self, sample: Sample) -> None:
        """Set ``sample.reward`` (per-sample reward functions); failures mark the sample failed."""
        try:
            sample.reward = _check_value(await self._call(sample), self.reward_key)
        except Exception as e:  # the user's reward code: any error fails this one sample, counted
            log.warning("%s %s failed on sample %s (group %s): %s: %s", self.flag, self.path, sample.index,
                        sample.group_index, type(e).__name__, e)
            mark_failed(sample, _reason(e))

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
            values = await self._call(todo)
            if not isinstance(values, (list, tuple)) or len(values) != len(todo):
                raise ValueError(f"--group-rm function returned {type(values).__name__} of "
                                 f"{len(values) if isinstance(values, (list, tuple)) else '?'} values "
                                 f"for {len(todo)} samples")
        except Exception as e:  # a failed batched call fails every sample it was scoring
            log.warning("%s %s (--group-rm) failed on group %s: %s: %s", self.flag, self.path, todo[0].group_index,
                        type(e).__name__, e)
            for s in todo:
                mark_failed(s, _reason(e) if isinstance(e, PluginTimeout) else f"reward: {type(e).__name__}")
            return
        for s, v in zip(todo, values):
            try:
                s.reward = _check_value(v, self.reward_key)
            except (TypeError, ValueError) as e:
                log.warning("%s %s (--group-rm) gave sample %s (group %s) a bad reward: %s", self.flag, self.path,
                            s.index, s.group_index, e)
                mark_failed(s, _reason(e))
