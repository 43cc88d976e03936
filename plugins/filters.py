"""Built-in dynamic-sampling filter (slime's signature: ``filter(args, samples) -> bool``, keep?).

``--dynamic-sampling-filter-path plugins.filters.check_reward_nonzero_std`` drops groups whose
rewards are all equal: with group-normalised advantages (GRPO) such a group has zero advantage
everywhere and teaches nothing.
"""

from __future__ import annotations

from typing import Any


def check_reward_nonzero_std(args: Any, samples: list[Any]) -> bool:
    """Keep the group only if at least two of its scored samples have different rewards."""
    rewards = [s.scalar_reward(args.reward_key) for s in samples if s.reward is not None]
    return len(rewards) >= 2 and max(rewards) > min(rewards)
