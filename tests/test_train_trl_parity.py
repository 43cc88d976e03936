"""GRPO, DAPO, Dr. GRPO and GSPO against TRL on the same batch: same loss, same gradient (also with
samples that have no loss token, and at a log-ratio of 25).

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

from buffer.sample import Sample, Status  # noqa: E402
from train_backend import TrainSettings  # noqa: E402
from train_backend.batching import begin_train_step, pack  # noqa: E402
from train_backend.losses import (LossConfig, LossDenominators, compute_advantages,  # noqa: E402
                                  count_samples_without_loss_tokens, rl_loss)

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
    b, t = logp.shape

    def per_token(model, input_ids, attention_mask, logits_to_keep, **kw):
        return logp, torch.zeros_like(logp), None

    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=per_token, aux_loss_enabled=False, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta, loss_type=loss_type,
        epsilon_low=eps, epsilon_high=eps_high, use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=t, _entropy_bonus_enabled=False,
        accelerator=_Accel(), _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1))
    inputs = {"prompt_ids": torch.ones(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
              "completion_ids": torch.ones(b, t, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    return trl_grpo.GRPOTrainer._compute_loss(fake, None, inputs)


def _trl_advantages(rewards, scale, group=G):
    """grpo_trainer.py L2765-2787 (sum_then_normalize, one reward function)."""
    mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
    std = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
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


@pytest.mark.parametrize("loss_type, agg", [("grpo", "seq_mean_token_mean"), ("dr_grpo", "seq_mean_token_sum_norm")])
def test_samples_without_loss_tokens_match_trl(loss_type, agg):
    # 16 completions, 2 with no loss token (an all-zero loss mask, an empty response): TRL keeps
    # them in its batch, so they count in the mean over sequences (grpo) and in B x max length
    # (dr_grpo). Reservoir sets them aside before packing and adds them back to the step's count.
    b, t = 16, 7
    g = torch.Generator().manual_seed(7)
    lengths = [1 + (3 * i) % t for i in range(b)]
    lengths[11] = 0  # an empty response
    mask = (torch.arange(t)[None] < torch.tensor(lengths)[:, None]).double()  # [b, t]
    mask[2, 1] = 0.0
    mask[5] = 0.0  # a response with an all-zero loss mask
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2  # [b, t]
    old = logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)  # [b, t]
    rewards = torch.rand(b, generator=g, dtype=torch.float64).round()  # [b]
    scale = loss_type == "grpo"
    adv = _trl_advantages(rewards, scale, group=4)  # [b]

    trl_logp = logp.clone().requires_grad_()
    trl = _trl_loss(loss_type, "token", trl_logp, old, old, adv, mask, 0.2, 0.28, 0.0)
    trl.backward()

    samples = [Sample(tokens=[1, 2] + [3] * n, response_length=n, loss_mask=mask[i, :n].long().tolist(),
                      reward=float(rewards[i]), status=Status.COMPLETED, weight_versions=[0])
               for i, n in enumerate(lengths)]
    settings = TrainSettings(hf_checkpoint="m", loss_agg=agg, loss_agg_norm_length=t)
    start = begin_train_step([samples[k:k + 4] for k in range(0, b, 4)], settings, 0, None)
    kept = [next(i for i, y in enumerate(samples) if y is x) for x in start.batch.samples]
    assert len(kept) == 14
    (denom,) = count_samples_without_loss_tokens(
        start.denominators, start.batch.skipped["empty_response"] + start.batch.skipped["zero_loss_mask"])
    mb = pack(start.batch.samples)
    rows = torch.tensor(kept)
    flat = lambda x: torch.cat([x[i, :lengths[i]] for i in kept])  # noqa: E731  [N]
    our_logp = logp.clone().requires_grad_()
    cfg = LossConfig(eps_clip=0.2, eps_clip_high=0.28, loss_agg=agg)
    ours, _ = rl_loss(cfg, denom, flat(our_logp), flat(old), adv[rows][mb.seq_ids], flat(mask), mb.seq_ids,
                      mb.num_seqs)
    ours.backward()
    assert ours.item() == pytest.approx(trl.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(our_logp.grad, trl_logp.grad, rtol=0, atol=1e-12)
    assert our_logp.grad.abs().sum() > 0


def test_log_ratio_25_matches_trl():
    # TRL clamps neither the PPO ratio nor its k3 term: a token at log-ratio 25 with A < 0 gives
    # loss and gradient e^25 = 7.2e10 (times 1 / its sequence's tokens / B), a policy e^25 below the
    # reference gives k3 = e^25 - 26.
    logp, old, ref, rewards, mask = (x.double() for x in _batch(seed=3))
    adv = _trl_advantages(rewards, True)  # [B]
    assert adv[1] < 0
    old[1, 0] = logp[1, 0] - 25.0  # ratio e^25 where A < 0
    ref[4, 2] = logp[4, 2] + 25.0  # policy e^25 below the reference
    beta = 0.04
    trl_logp = logp.clone().requires_grad_()
    trl = _trl_loss("grpo", "token", trl_logp, old, ref, adv, mask, 0.2, 0.2, beta)
    trl.backward()

    our_logp = logp.clone().requires_grad_()
    seq_ids = torch.arange(B).repeat_interleave(T)  # [B*T]
    flat_mask = mask.flatten()  # [B*T]
    cfg = LossConfig(eps_clip=0.2, loss_agg="seq_mean_token_mean", use_kl_loss=True, kl_coef=beta)
    denom = LossDenominators.of_batch(flat_mask, seq_ids, B, norm_length=T)
    ours, _ = rl_loss(cfg, denom, our_logp.flatten(), old.flatten(), adv.repeat_interleave(T), flat_mask, seq_ids,
                      B, ref_logp=ref.flatten())
    ours.backward()
    assert trl.item() > 1e9  # the e^25 terms dominate
    assert ours.item() == pytest.approx(trl.item(), rel=1e-12)
    assert torch.allclose(our_logp.grad, trl_logp.grad, rtol=1e-12, atol=1e-12)
    assert abs(trl_logp.grad[1, 0].item()) > 1e9 and abs(trl_logp.grad[4, 2].item()) > 1e7
