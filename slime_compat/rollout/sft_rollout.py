"""``slime.rollout.sft_rollout``: ``generate_rollout``, slime's SFT rollout (conversations become
samples whose loss mask covers the assistant turns; ``rollout_manager/sft.py``). With
``--rollout-function-path slime.rollout.sft_rollout.generate_rollout`` the rollout manager loads
``--prompt-data`` as conversations; train it with ``--loss-type sft_loss``."""

from __future__ import annotations

from rollout_manager.sft import generate_rollout

__all__ = ["generate_rollout"]
