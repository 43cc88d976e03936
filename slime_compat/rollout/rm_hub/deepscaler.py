"""``slime.rollout.rm_hub.deepscaler``: slime's deepscaler rule (``--rm-type deepscaler``)."""

from __future__ import annotations

from typing import Any

from plugins.rewards import deepscaler_reward


def get_deepscaler_rule_based_reward(response: str, label: Any) -> int:
    """1 if the boxed answer after ``</think>`` (or ``###Response``) matches ``label``, else 0."""
    return int(deepscaler_reward(response, label))
