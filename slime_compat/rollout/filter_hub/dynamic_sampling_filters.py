"""``slime.rollout.filter_hub.dynamic_sampling_filters``: slime's built-in filters."""

from __future__ import annotations

import statistics
from typing import Any

from buffer.sample import Sample
from slime_compat.rollout.filter_hub.base_types import DynamicFilterOutput

__all__ = ["check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"]


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group whose rewards differ (DAPO's dynamic sampling); the reason names the shared value."""
    rewards = [float(s.get_reward_value(args)) for s in samples if s.reward is not None]
    keep = len(rewards) > 1 and statistics.stdev(rewards) > 1e-6
    reason = None if keep else (f"zero_std_{round(rewards[0], 1)}" if rewards else "no_rewards")
    return DynamicFilterOutput(keep=keep, reason=reason)


def check_reward_nonzero_std_with_fallback(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """The same, but a rejected group is kept when no other candidate could take its place."""
    out = check_reward_nonzero_std(args, samples, **kwargs)
    out.keep_when_insufficient = True
    return out
