"""GRPO, DAPO, Dr. GRPO and GSPO against TRL on the same batch: same loss, same gradient.

The loss side runs TRL's own code: ``GRPOTrainer._compute_loss`` (trl 1.16,
trl/trainer/grpo_trainer.py ~L3020-3290) is called unbound with a stand-in ``self`` that hands it
our log-probs, so the comparison is against TRL's arithmetic itself, not a re-reading of it.
TRL's advantages live inside its generation method; they are re-derived below from
grpo_trainer.py L2765-2787 (group mean, Bessel std via ``trl.trainer.utils.nanstd``, ``+ 1e-4``).
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
from trl.trainer.utils import nanstd  # noqa: E402

from train_backend.losses import LossConfig, LossDenominators, compute_advantages, rl_loss  # noqa: E402

B, T, G = 6, 7, 3  # 2 prompts x 3 generations, completions padded to 7 tokens


class _Accel:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _trl_loss(loss_type, level, logp, old, ref, adv, mask, eps, eps_high, beta):
    """TRL's loss on (logp [B, T], ...) with a stand-in trainer."""
    def per_token(model, input_ids, attention_mask, logits_to_keep, **kw):
        return logp, torch.zeros_like(logp), None

    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=per_token, aux_loss_enabled=False, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta, loss_type=loss_type,
        epsilon_low=eps, epsilon_high=eps_high, use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=T, _entropy_bonus_enabled=False,
        accelerator=_Accel(), _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1))
    inputs = {"prompt_ids": torch.ones(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.ones(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    return trl_grpo.GRPOTrainer._compute_loss(fake, None, inputs)


def _trl_advantages(rewards, scale):
    """grpo_trainer.py L2765-2787 (sum_then_normalize, one reward function)."""
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    adv = rewards - mean
    return adv / (std + 1e-4) if scale else adv


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()  # [B, T]
    mask[2, 1] = 0.0  # a masked token inside a response (e.g. a tool output)
    logp = -torch.rand(B, T, generator=g) * 2  # [B, T]
    old = logp + 0.3 * torch.randn(B, T, generator=g)  # [B, T] ratios both inside and outside the clip range
    ref = logp + 0.2 * torch.randn(B, T, generator=g)  # [B, T]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0])
    return logp, old, ref, rewards, mask


CASES = {
    # name: (TRL loss_type, TRL level, scale rewards, eps_high, beta, our estimator, our loss_agg)
    "grpo": ("grpo", "token", True, 0.2, 0.0, "grpo", "seq_mean_token_mean"),
    "grpo_kl": ("grpo", "token", True, 0.2, 0.04, "grpo", "seq_mean_token_mean"),
    "dapo": ("dapo", "token", True, 0.28, 0.0, "grpo", "token_mean"),
    "dr_grpo": ("dr_grpo", "token", False, 0.2, 0.0, "dr_grpo", "seq_mean_token_sum_norm"),
    "gspo": ("grpo", "sequence", True, 0.2, 0.0, "gspo", "seq_mean_token_mean"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_trl(name):
    loss_type, level, scale, eps_high, beta, estimator, agg = CASES[name]
    logp, old, ref, rewards, mask = _batch(seed=len(name))

    trl_adv = _trl_advantages(rewards, scale)
    ours_adv = compute_advantages(rewards.view(-1, G), estimator, eps=1e-4).flatten()
    assert torch.allclose(ours_adv, trl_adv, atol=1e-6)

    trl_logp = logp.clone().requires_grad_()
    trl_loss = _trl_loss(loss_type, level, trl_logp, old, ref, trl_adv, mask, 0.2, eps_high, beta)
    trl_loss.backward()

    our_logp = logp.clone().requires_grad_()
    seq_ids = torch.arange(B).repeat_interleave(T)  # [B*T]
    flat_mask = mask.flatten()  # [B*T]
    cfg = LossConfig(sequence_level_ratio=estimator == "gspo", eps_clip=0.2, eps_clip_high=eps_high, loss_agg=agg,
                     use_kl_loss=beta > 0, kl_coef=beta, kl_loss_type="k3")
    denom = LossDenominators.of_batch(flat_mask, seq_ids, B, norm_length=T)
    ours, stats = rl_loss(cfg, denom, our_logp.flatten(), old.flatten(), ours_adv.repeat_interleave(T), flat_mask,
                          seq_ids, B, ref_logp=ref.flatten() if beta > 0 else None)
    ours.backward()

    assert ours.item() == pytest.approx(trl_loss.item(), abs=1e-6)
    assert torch.allclose(our_logp.grad, trl_logp.grad, atol=1e-6)
    assert our_logp.grad.abs().sum() > 0  # the comparison is not vacuous
    if level == "token":  # some ratios were clipped, so the clip branch is exercised too
        assert stats["pg_clipfrac"] > 0
