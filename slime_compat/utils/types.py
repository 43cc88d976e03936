"""``slime.utils.types``: ``Sample`` is Reservoir's own ``buffer.sample.Sample`` (slime's fields,
nested ``Sample.Status``, ``append_response_tokens``, ``get_reward_value``...), so the samples
the rollout hands a plugin are instances of the class the plugin imports."""

from __future__ import annotations

from typing import Any

from buffer.sample import Sample, Status  # noqa: F401

# slime's name for the dict-of-lists training batch; Reservoir trains on groups of Samples.
RolloutBatch = dict[str, Any]

__all__ = ["Sample", "RolloutBatch"]
