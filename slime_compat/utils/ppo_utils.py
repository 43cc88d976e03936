"""``slime.utils.ppo_utils``: the loss pieces custom loss functions import, on Reservoir's math
(:mod:`train_backend.losses`) with slime's signatures."""

from __future__ import annotations

from torch import Tensor

from train_backend.losses import kl_penalty, policy_loss


def compute_approx_kl(log_probs: Tensor, log_probs_base: Tensor, kl_loss_type: str,
                      importance_ratio: Tensor | None = None) -> Tensor:
    """KL(policy || base) estimate per token: k1, k2, k3 or low_var_kl (k3 clamped to [-10, 10]);
    ``importance_ratio`` multiplies it before the clamp, as in slime."""
    kl = kl_penalty(log_probs.float(), log_probs_base.float(), "k3" if kl_loss_type == "low_var_kl" else kl_loss_type)
    if importance_ratio is not None:
        kl = importance_ratio * kl
    return kl.clamp(-10.0, 10.0) if kl_loss_type == "low_var_kl" else kl


def compute_policy_loss(ppo_kl: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float,
                        eps_clip_c: float | None = None) -> tuple[Tensor, Tensor]:
    """PPO-clip per token from ``ppo_kl = old_logp - logp``: ``(pg_losses, clipfrac)``."""
    return policy_loss(-ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c)
