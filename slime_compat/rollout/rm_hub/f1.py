"""``slime.rollout.rm_hub.f1``: ``f1_score(prediction, ground_truth) -> (f1, precision, recall)``
(``--rm-type f1``'s rule, ``plugins.rewards.f1_reward``)."""

from __future__ import annotations

from plugins.rewards import f1_reward as f1_score  # noqa: F401
