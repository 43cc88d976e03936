"""Each loss and estimator of train_backend.losses against closed-form small cases."""

from __future__ import annotations

import math

import pytest
import torch

from train_backend.losses import (LossConfig, LossDenominators, aggregate, compute_advantages, kl_penalty,
                                  log_probs_from_logits, masked_whiten, policy_loss, rl_loss,
                                  sequence_log_ratio, tis_weights)

NAN = float("nan")


# --- advantages ---------------------------------------------------------------------------------
def test_grpo_closed_form():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv = compute_advantages(r, "grpo")
    # group 0: mean .5, unbiased std sqrt(1/3)
    s = math.sqrt(1 / 3)
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (s + 1e-6))
    assert torch.equal(adv[1], torch.zeros(4))  # all equal: no signal, and no NaN
    assert torch.equal(compute_advantages(r, "gspo"), adv)


def test_dr_grpo_and_rloo_closed_form():
    r = torch.tensor([[3.0, 1.0, 2.0]])
    assert torch.allclose(compute_advantages(r, "dr_grpo"), torch.tensor([[1.0, -1.0, 0.0]]))
    # rloo: r_i - mean of the others = r_i - (6 - r_i) / 2
    assert torch.allclose(compute_advantages(r, "rloo"), torch.tensor([[1.5, -1.5, 0.0]]))


def test_reinforce_plus_plus_whitens_over_the_batch():
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    adv = compute_advantages(r, "reinforce_plus_plus").double()
    flat = r.flatten().double()
    assert torch.allclose(adv.flatten(), (flat - flat.mean()) / (flat.std() + 1e-6))
    base = compute_advantages(r, "reinforce_plus_plus_baseline").double()
    centred = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64)
    assert torch.allclose(base.flatten(), (centred - centred.mean()) / (centred.std() + 1e-6), atol=1e-6)


def test_nan_slots_are_left_out_of_baselines():
    r = torch.tensor([[1.0, 0.0, NAN], [5.0, NAN, NAN]])
    for est in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        adv = compute_advantages(r, est)
        assert torch.isfinite(adv).all(), est
        assert adv[0, 2] == 0 and adv[1, 1] == 0 and adv[1, 2] == 0
    assert torch.allclose(compute_advantages(r, "dr_grpo")[0, :2], torch.tensor([0.5, -0.5]))
    assert compute_advantages(r, "grpo")[1, 0] == 0  # a group of one has no baseline signal


def test_unknown_estimator_names_the_flag():
    with pytest.raises(ValueError, match="--advantage-estimator"):
        compute_advantages(torch.zeros(1, 2), "ppo")


def test_masked_whiten_matches_slime_formula():
    # slime/utils/distributed_utils.py `distributed_masked_whiten` (one rank): mean and Bessel-
    # corrected variance over masked entries, then (v - mean) * rsqrt(var + eps).
    v = torch.tensor([1.0, 2.0, 4.0, 100.0], dtype=torch.float64)
    m = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    n = m.sum()
    mean = (v * m).sum() / n
    var = ((v * v * m).sum() / n - mean ** 2) * n / (n - 1)
    expected = (v - mean) * torch.rsqrt(var + 1e-8) * m
    assert torch.allclose(masked_whiten(v, m), expected)
    w = masked_whiten(v, m)[:3]
    assert abs(float(w.mean())) < 1e-9 and abs(float(w.std()) - 1) < 1e-6


# --- policy loss --------------------------------------------------------------------------------
def _lr(ratios):
    return torch.log(torch.tensor(ratios, dtype=torch.float64))


def test_ppo_clip_closed_form():
    log_ratio = _lr([1.5, 0.5, 0.5, 1.0, 1.1])
    adv = torch.tensor([1.0, 1.0, -1.0, -2.0, 1.0], dtype=torch.float64)
    loss, clipped = policy_loss(log_ratio, adv, eps_clip=0.2)
    # max(-r A, -clip(r) A): r=1.5,A=1 -> -1.2 (clipped); r=.5,A=1 -> -.5; r=.5,A=-1 -> .8 (clipped);
    # r=1,A=-2 -> 2; r=1.1,A=1 -> -1.1 (inside the range)
    assert torch.allclose(loss, torch.tensor([-1.2, -0.5, 0.8, 2.0, -1.1], dtype=torch.float64))
    assert clipped.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]


def test_clip_higher_and_dual_clip():
    loss, _ = policy_loss(_lr([1.5]), torch.tensor([1.0], dtype=torch.float64), 0.2, eps_clip_high=0.28)
    assert torch.allclose(loss, torch.tensor([-1.28], dtype=torch.float64))
    # A < 0 and a huge ratio: PPO's loss is r * |A| = 5; dual clip bounds it by c * |A| = 3
    adv = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    loss, _ = policy_loss(_lr([5.0, 5.0]), adv, 0.2, eps_clip_c=3.0)
    assert torch.allclose(loss, torch.tensor([3.0, -1.2], dtype=torch.float64))
    loss, _ = policy_loss(_lr([5.0]), adv[:1], 0.2)
    assert torch.allclose(loss, torch.tensor([5.0], dtype=torch.float64))


def test_policy_gradient_at_ratio_one_is_minus_advantage():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    adv = torch.tensor([2.0, -3.0])
    loss, _ = policy_loss(logp - logp.detach(), adv, 0.2)
    loss.sum().backward()
    assert torch.allclose(logp.grad, -adv)


def test_huge_log_ratio_stays_finite():
    loss, _ = policy_loss(torch.tensor([500.0, -500.0]), torch.tensor([-1.0, 1.0]), 0.2)
    assert torch.isfinite(loss).all()


def test_gspo_sequence_ratio():
    logp = torch.tensor([-1.0, -2.0, -3.0, -1.0], requires_grad=True)
    old = torch.tensor([-1.5, -2.0, -2.0, -1.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    seq = torch.tensor([0, 0, 1, 1])
    lr = sequence_log_ratio(logp, old, mask, seq, 2)
    assert torch.allclose(lr, torch.tensor([0.25, 0.25, -1.0, -1.0]))
    lr.sum().backward()  # d/dlogp of each sequence's mean, counted on its 2 tokens
    assert torch.allclose(logp.grad, torch.tensor([1.0, 1.0, 2.0, 0.0]))


# --- KL, TIS ------------------------------------------------------------------------------------
def test_kl_estimators_closed_form():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = logp - ref  # [0.5, -1.0]
    assert torch.allclose(kl_penalty(logp, ref, "k1"), d)
    assert torch.allclose(kl_penalty(logp, ref, "k2"), 0.5 * d * d)
    assert torch.allclose(kl_penalty(logp, ref, "k3"), torch.exp(-d) - 1 + d)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="--kl-loss-type"):
        kl_penalty(logp, ref, "k4")


def test_kl_estimators_are_unbiased_for_the_true_kl():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(6), 0)
    q = torch.softmax(torch.randn(6), 0)
    true_kl = float((p * (p.log() - q.log())).sum())
    x = torch.multinomial(p, 200_000, replacement=True)
    for kind in ("k1", "k3"):
        est = float(kl_penalty(p.log()[x], q.log()[x], kind).mean())
        assert abs(est - true_kl) < 0.02, (kind, est, true_kl)


def test_tis_weights():
    w = tis_weights(torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-1.0, -3.0, -0.5]), cap=2.0)
    assert torch.allclose(w, torch.tensor([1.0, 2.0, math.exp(-0.5)]))


# --- aggregation --------------------------------------------------------------------------------
def test_aggregation_modes_closed_form():
    # seq 0: values 1, 2 (+ a masked 9); seq 1: value 6
    v = torch.tensor([1.0, 2.0, 9.0, 6.0])
    m = torch.tensor([1.0, 1.0, 0.0, 1.0])
    seq = torch.tensor([0, 0, 0, 1])
    d = LossDenominators.of_batch(m, seq, 2, norm_length=4)
    assert d == LossDenominators(3.0, 2.0, 4.0)
    assert aggregate(v, m, "token_mean", seq, 2, d) == pytest.approx(9 / 3)
    assert aggregate(v, m, "seq_mean_token_mean", seq, 2, d) == pytest.approx((1.5 + 6) / 2)
    assert aggregate(v, m, "seq_mean_token_sum_norm", seq, 2, d) == pytest.approx(9 / (2 * 4))
    assert LossDenominators.of_batch(m, seq, 2).norm_length == 3  # longest response
    with pytest.raises(ValueError, match="--loss-agg"):
        aggregate(v, m, "sum", seq, 2, d)


def test_log_probs_match_categorical_at_temperature():
    torch.manual_seed(0)
    logits = torch.randn(5, 11)
    targets = torch.randint(11, (5,))
    logp, ent = log_probs_from_logits(logits, targets, temperature=0.7, with_entropy=True)
    dist = torch.distributions.Categorical(logits=logits / 0.7)
    assert torch.allclose(logp, dist.log_prob(targets), atol=1e-6)
    assert torch.allclose(ent, dist.entropy(), atol=1e-6)


# --- the whole objective: micro-batching does not change the loss or its gradient ----------------
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("gspo", [False, True])
def test_rl_loss_is_invariant_to_micro_batching(agg, gspo):
    torch.manual_seed(1)
    lens = [3, 5, 2, 4]
    n = sum(lens)
    seq = torch.repeat_interleave(torch.arange(4), torch.tensor(lens))
    logp = (-torch.rand(n) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(n)
    ref = logp.detach() + 0.2 * torch.randn(n)
    roll = old + 0.1 * torch.randn(n)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[seq]
    mask = (torch.rand(n) > 0.2).float()
    mask[0] = 1.0
    ent = torch.rand(n, requires_grad=True)
    cfg = LossConfig(sequence_level_ratio=gspo, eps_clip=0.2, eps_clip_high=0.3, eps_clip_c=3.0, loss_agg=agg,
                     use_kl_loss=True, kl_coef=0.1, entropy_coef=0.01, use_tis=True, tis_cap=1.5)
    denom = LossDenominators.of_batch(mask, seq, 4, norm_length=6)
    ones = torch.ones(n)
    full, _ = rl_loss(cfg, denom, logp, old, adv, mask, seq, 4, ent, ref, roll, ones)
    g_full = torch.autograd.grad(full, [logp, ent])
    # the same tokens in two micro-batches (sequences {0, 1} and {2, 3}), step-wide denominators
    parts = []
    for lo, hi, s0 in ((0, 8, 0), (8, 14, 2)):
        sl = slice(lo, hi)
        loss, _ = rl_loss(cfg, denom, logp[sl], old[sl], adv[sl], mask[sl], seq[sl] - s0, 2, ent[sl], ref[sl],
                          roll[sl], ones[sl])
        parts.append(loss)
    total = parts[0] + parts[1]
    g_parts = torch.autograd.grad(total, [logp, ent])
    assert torch.allclose(full, total, atol=1e-6)
    for a, b in zip(g_full, g_parts):
        assert torch.allclose(a, b, atol=1e-6)


def test_rl_loss_tis_needs_rollout_log_probs():
    cfg = LossConfig(use_tis=True)
    x = torch.zeros(2)
    d = LossDenominators(2.0, 1.0, 2.0)
    with pytest.raises(ValueError, match="--use-tis"):
        rl_loss(cfg, d, x, x, x, torch.ones(2), torch.zeros(2, dtype=torch.long), 1, rollout_logp=x,
                rollout_mask=torch.tensor([1.0, 0.0]))
