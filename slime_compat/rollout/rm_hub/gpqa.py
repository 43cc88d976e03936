"""``slime.rollout.rm_hub.gpqa``: ``compute_gpqa_reward(response, label, metadata=None)``
(``--rm-type gpqa``'s rule, ``plugins.rewards.gpqa_reward``)."""

from __future__ import annotations

from plugins.rewards import gpqa_reward as compute_gpqa_reward  # noqa: F401
