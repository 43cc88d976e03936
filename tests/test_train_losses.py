"""Each loss and estimator of train_backend.losses against closed-form small cases and slime's
published formulas (written out below, on the same fp64 inputs)."""

from __future__ import annotations

import math

import pytest
import torch

from buffer.sample import Sample, Status
from train_backend import TrainSettings
from train_backend.batching import begin_train_step, pack
from train_backend.losses import (LossConfig, LossDenominators, aggregate, compute_advantages,
                                  count_samples_without_loss_tokens, kl_penalty, log_probs_from_logits,
                                  masked_whiten, policy_loss, rl_loss, sequence_log_ratio, truncated_is)

NAN = float("nan")
F64 = torch.float64


# --- slime's published formulas, written out (slime/utils/ppo_utils.py, slime/utils/
# distributed_utils.py, slime/backends/megatron_utils/{loss,cp_utils}.py), on per-sample lists --
def _slime_reinforce_pp_returns(rewards, masks):
    """``get_reinforce_plus_plus_returns`` with kl_coef = 0 (KL goes through --use-kl-loss) and
    slime's default gamma = 1: the reward on the last loss token, discounted returns backwards."""
    out = []
    for r, m in zip(rewards, masks):
        token_rewards = torch.zeros(len(m), dtype=F64)
        token_rewards[m.nonzero()[-1, 0]] += r
        out.append(token_rewards.flip(0).cumsum(0).flip(0))  # G_t = sum_{k >= t} r_k
    return out


def _slime_masked_whiten(values, mask, eps=1e-8):
    """``distributed_masked_whiten`` on one rank: E[x^2] - mean^2, Bessel-corrected."""
    n = mask.sum()
    mean = (values * mask).sum() / n
    var = ((values ** 2) * mask).sum() / n - mean ** 2
    if n >= 2:
        var = var * n / (n - 1)
    return (values - mean) * torch.rsqrt(var + eps)


def _slime_sample_mean(values, masks):
    """``sum_of_sample_mean`` / the step's samples (slime's loss and metrics without per-token loss)."""
    return sum((v * m).sum() / m.sum().clamp(min=1) for v, m in zip(values, masks)) / len(masks)


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


def _rpp_samples():
    """3 groups of 3 with uneven responses and masked tokens inside them (e.g. tool output)."""
    g = torch.Generator().manual_seed(3)
    rewards = [[1.0, 0.0, 0.5], [0.0, 0.0, 1.0], [2.0, -1.0, 0.25]]
    groups = []
    for gi, row in enumerate(rewards):
        group = []
        for si, r in enumerate(row):
            n = 1 + (3 * gi + 2 * si) % 7
            mask = [int(x) for x in (torch.rand(n, generator=g) > 0.3).tolist()]
            mask[0] = 1
            group.append(Sample(tokens=[1, 2] + [3] * n, response_length=n, loss_mask=mask, reward=r,
                                status=Status.COMPLETED, weight_versions=[0]))
        groups.append(group)
    return groups


def test_reinforce_plus_plus_advantages_are_slimes_unwhitened_returns():
    # Without --normalize-advantages slime leaves REINFORCE++'s return (the reward itself with
    # gamma = 1) and REINFORCE++-baseline's r - mean_g unscaled; Reservoir used to whiten them
    # per sample here, which no slime path does.
    groups = _rpp_samples()
    r = torch.tensor([[s.reward for s in grp] for grp in groups], dtype=F64)  # [G, n]
    masks = [torch.tensor(s.loss_mask, dtype=F64) for grp in groups for s in grp]
    for est, rewards in (("reinforce_plus_plus", r), ("reinforce_plus_plus_baseline", r - r.mean(1, keepdim=True))):
        ours = compute_advantages(r, est).flatten()  # [B]
        slime = _slime_reinforce_pp_returns(rewards.flatten().tolist(), masks)
        for a, ret, m in zip(ours, slime, masks):
            assert torch.allclose(a * m, ret * m, rtol=0, atol=1e-12), est  # on the loss tokens
    # slime asserts --normalize-advantages with both estimators; so do the settings
    for est in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match="normalize_advantages"):
            TrainSettings(hf_checkpoint="m", advantage_estimator=est)


@pytest.mark.parametrize("est", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_with_normalize_advantages_matches_slime(est):
    # slime whitens the token-level advantages over all loss tokens of the batch (a long
    # response weighs more than a short one), not per sample.
    groups = _rpp_samples()
    settings = TrainSettings(hf_checkpoint="m", advantage_estimator=est, normalize_advantages=True)
    start = begin_train_step(groups, settings, 0, None)
    samples = [s for grp in groups for s in grp]
    assert all(x is y for x, y in zip(start.batch.samples, samples, strict=True))
    rewards = torch.tensor([[s.reward for s in grp] for grp in groups], dtype=F64)  # [G, n]
    if est == "reinforce_plus_plus_baseline":  # slime's rollout side subtracts the group mean first
        rewards = rewards - rewards.mean(1, keepdim=True)
    masks = [torch.tensor(s.loss_mask, dtype=F64) for s in samples]
    slime = _slime_masked_whiten(torch.cat(_slime_reinforce_pp_returns(rewards.flatten().tolist(), masks)),
                                 torch.cat(masks))  # [tokens]
    ours = torch.cat([torch.full((len(m),), a, dtype=F64) for a, m in zip(start.advantages, masks)])  # [tokens]
    on = torch.cat(masks) > 0
    assert torch.allclose(ours[on], slime[on], rtol=0, atol=1e-12)


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
        compute_advantages(torch.zeros(1, 2), "gae")


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


def _slime_policy_loss(ppo_kl, adv, eps, eps_high, eps_c=None):
    """slime's ``compute_policy_loss`` (``ppo_kl = old_logp - logp``; no clamp anywhere)."""
    ratio = (-ppo_kl).exp()
    l1, l2 = -ratio * adv, -ratio.clamp(1 - eps, 1 + eps_high) * adv
    loss = torch.maximum(l1, l2)
    if eps_c is not None:
        loss = torch.where(adv < 0, torch.min(-eps_c * adv, loss), loss)
    return loss


@pytest.mark.parametrize("eps_c", [None, 3.0])
def test_log_ratio_25_is_not_clamped(eps_c):
    # A < 0 and a ratio of e^25 without dual clip: PPO's loss is r |A| = 7.2e10 and so is its
    # gradient (slime, TRL); a clamp of the log-ratio at 20 made it e^20 with zero gradient.
    old = torch.tensor([-30.0, -30.0, -5.0, -1.0], dtype=F64)
    adv = torch.tensor([-1.0, 1.0, -1.0, -0.5], dtype=F64)
    log_ratio = torch.tensor([25.0, 25.0, -25.0, 21.0], dtype=F64)
    logp = (old + log_ratio).requires_grad_()
    ours, _ = policy_loss(logp - old, adv, 0.2, 0.28, eps_c)
    (g_ours,) = torch.autograd.grad(ours.sum(), logp)
    ref_logp = (old + log_ratio).requires_grad_()
    ref = _slime_policy_loss(old - ref_logp, adv, 0.2, 0.28, eps_c)
    (g_ref,) = torch.autograd.grad(ref.sum(), ref_logp)
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(g_ours, g_ref, rtol=1e-12, atol=1e-12)
    if eps_c is None:
        assert ours[0].item() == pytest.approx(math.exp(25), rel=1e-12)  # 7.2e10
        assert g_ours[0].item() == pytest.approx(math.exp(25), rel=1e-12)
        assert g_ours[3].item() == pytest.approx(0.5 * math.exp(21), rel=1e-12)
    else:
        assert ours[0].item() == 3.0 and g_ours[0].item() == 0.0  # dual clip bounds it at c |A|


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


def test_k3_is_not_clamped_past_20():
    # slime's compute_approx_kl (k3): exp(-log r) - 1 + log r, with no clamp (TRL's k3 term alike)
    ref = torch.tensor([-1.0, -1.0, -1.0, -40.0], dtype=F64)
    logp = (ref + torch.tensor([-25.0, -21.0, -19.0, 30.0], dtype=F64)).requires_grad_()
    ours = kl_penalty(logp, ref, "k3")
    (g_ours,) = torch.autograd.grad(ours.sum(), logp)
    x = logp.detach().clone().requires_grad_()
    neg = -(x - ref)
    slime = neg.exp() - 1 - neg
    (g_slime,) = torch.autograd.grad(slime.sum(), x)
    assert torch.allclose(ours, slime, rtol=1e-12, atol=1e-12)
    assert torch.allclose(g_ours, g_slime, rtol=1e-12, atol=1e-12)
    assert ours[0].item() == pytest.approx(math.exp(25) - 26, rel=1e-12)


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
    ones = torch.ones(3)
    _, _, stats = truncated_is(ones, torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-1.0, -3.0, -0.5]), ones,
                               torch.zeros(3, dtype=torch.long), 1, cap=2.0)
    assert torch.allclose(stats["tis_weight"], torch.tensor([1.0, 2.0, math.exp(-0.5)]))


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


def _batch_with_two_unscored(seed=0):
    """16 samples (4 groups of 4), uneven responses with masked tokens inside; sample 5 has an
    all-zero loss mask and sample 11 an empty response. Per sample: random fp64 logp / old / ref /
    rollout log-probs and entropies ([response_length] each)."""
    g = torch.Generator().manual_seed(seed)
    samples, per_sample = [], []
    for i in range(16):
        n = 0 if i == 11 else 1 + (5 * i) % 7
        mask = (torch.rand(n, generator=g) > 0.25).long().tolist()
        if n:
            mask[0] = 1
        if i == 5:
            mask = [0] * n
        samples.append(Sample(tokens=[1, 2] + [3] * n, response_length=n, loss_mask=mask,
                              reward=float(torch.rand((), generator=g)), status=Status.COMPLETED, weight_versions=[0]))
        logp = -torch.rand(n, generator=g, dtype=F64) * 3
        per_sample.append({"logp": logp, "old": logp + 0.4 * torch.randn(n, generator=g, dtype=F64),
                           "ref": logp + 0.3 * torch.randn(n, generator=g, dtype=F64),
                           "rollout": logp + 0.3 * torch.randn(n, generator=g, dtype=F64),
                           "entropy": torch.rand(n, generator=g, dtype=F64) * 2,
                           "mask": torch.tensor(mask, dtype=F64)})
    return [samples[k:k + 4] for k in range(0, 16, 4)], per_sample


def _reservoir_step(agg, groups, per_sample, cfg_kw, norm_length=7):
    """What a backend does with one step: the shared batch head, the step denominators (with the
    samples that have no loss token), one packed micro-batch, ``rl_loss`` in fp64."""
    settings = TrainSettings(hf_checkpoint="m", loss_agg=agg, loss_agg_norm_length=norm_length)
    start = begin_train_step(groups, settings, 0, None)
    (denom,) = count_samples_without_loss_tokens(
        start.denominators, start.batch.skipped["empty_response"] + start.batch.skipped["zero_loss_mask"])
    samples = [s for grp in groups for s in grp]
    kept = [next(i for i, y in enumerate(samples) if y is x) for x in start.batch.samples]
    mb = pack(start.batch.samples, start.advantages)
    cat = {k: torch.cat([per_sample[i][k] for i in kept]) for k in per_sample[0]}  # [N]
    logp = cat["logp"].clone().requires_grad_()
    adv = torch.tensor(start.advantages, dtype=F64)[mb.seq_ids]  # [N]
    cfg = LossConfig(loss_agg=agg, **cfg_kw)
    loss, stats = rl_loss(cfg, denom, logp, cat["old"], adv, cat["mask"], mb.seq_ids, mb.num_seqs,
                          entropy=cat["entropy"], ref_logp=cat["ref"], rollout_logp=cat["rollout"],
                          rollout_mask=torch.ones_like(cat["mask"]))
    (grad,) = torch.autograd.grad(loss, logp)
    all_adv = compute_advantages(torch.tensor([[s.reward for s in grp] for grp in groups], dtype=F64), "grpo")
    return loss, grad, stats, kept, all_adv.flatten()


@pytest.mark.parametrize("agg", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_samples_without_loss_tokens_count_in_the_seq_mean_denominators(agg):
    # slime divides the seq-mean losses by the step's samples, TRL by its batch: a sample with no
    # loss token adds 0 but counts. Leaving the 2 of 16 out made loss and gradient 16/14 of theirs.
    groups, per_sample = _batch_with_two_unscored()
    cfg_kw = dict(eps_clip=0.2, eps_clip_high=0.28, use_kl_loss=True, kl_coef=0.05, entropy_coef=0.01)
    loss, grad, _, kept, adv = _reservoir_step(agg, groups, per_sample, cfg_kw)
    assert len(kept) == 14
    # the reference, on all 16 samples
    logps = [p["logp"].clone().requires_grad_() for p in per_sample]
    masks = [p["mask"] for p in per_sample]
    token_loss = []
    for i, (lp, p) in enumerate(zip(logps, per_sample)):
        pg = _slime_policy_loss(p["old"] - lp, adv[i], 0.2, 0.28)
        neg = p["ref"] - lp
        token_loss.append(pg + 0.05 * (neg.exp() - 1 - neg) - 0.01 * p["entropy"])
    if agg == "seq_mean_token_mean":  # slime's sum_of_sample_mean / step samples (TRL's "grpo")
        ref = _slime_sample_mean(token_loss, masks)
    else:  # Dr. GRPO: token sums / (samples x generation budget) (TRL's "dr_grpo")
        ref = sum((t * m).sum() for t, m in zip(token_loss, masks)) / (16 * 7)
    ref_grad = torch.cat([g for i, g in enumerate(torch.autograd.grad(ref, logps)) if i in kept])
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(grad, ref_grad, rtol=0, atol=1e-12)
    assert grad.abs().sum() > 0


def test_samples_without_loss_tokens_spread_over_the_optimizer_steps():
    d = [LossDenominators(10.0, 3.0, 5.0), LossDenominators(9.0, 2.0, 5.0)]
    assert count_samples_without_loss_tokens(d, 3) == [LossDenominators(10.0, 5.0, 5.0),
                                                      LossDenominators(9.0, 3.0, 5.0)]
    assert count_samples_without_loss_tokens(d, 0) == d


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_metrics_are_per_sample_means_under_seq_mean_token_mean(agg):
    # slime reports clip fraction, ppo_kl, kl, entropy and TIS through sum_of_sample_mean (per-
    # sample means over the step's samples) unless the loss is per token (token_mean).
    groups, per_sample = _batch_with_two_unscored(seed=1)
    cfg_kw = dict(eps_clip=0.2, use_kl_loss=True, kl_coef=0.05, use_tis=True, tis_cap=1.2)
    _, _, stats, _, adv = _reservoir_step(agg, groups, per_sample, cfg_kw)
    per_token = {"pg_clipfrac": [], "ppo_kl": [], "kl": [], "entropy": [], "tis_weight": [], "tis": [], "tis_abs": [],
                 "tis_clipfrac": []}
    for i, p in enumerate(per_sample):
        ratio = (p["logp"] - p["old"]).exp()
        per_token["pg_clipfrac"].append((-ratio.clamp(0.8, 1.2) * adv[i] > -ratio * adv[i]).to(F64))
        per_token["ppo_kl"].append(p["old"] - p["logp"])
        neg = p["ref"] - p["logp"]
        per_token["kl"].append(neg.exp() - 1 - neg)
        per_token["entropy"].append(p["entropy"])
        tis = (p["old"] - p["rollout"]).exp()
        per_token["tis_weight"].append(tis.clamp(max=1.2))
        per_token["tis"].append(tis)  # slime's vanilla_tis_function: the raw ratio's mean
        per_token["tis_abs"].append((tis - 1).abs())
        per_token["tis_clipfrac"].append((tis > 1.2).to(F64))
    masks = [p["mask"] for p in per_sample]
    for name, values in per_token.items():
        if agg == "seq_mean_token_mean":
            ref = _slime_sample_mean(values, masks)
        else:
            ref = sum((v * m).sum() for v, m in zip(values, masks)) / sum(m.sum() for m in masks)
        assert stats[name].item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-12), name
    assert stats["pg_clipfrac"] > 0 and stats["tis_clipfrac"] > 0  # not vacuous


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


def _rejecting_tis(pg, old_logp, rollout_logp, mask, seq_ids, num_seqs):
    """A custom TIS function in the shape of slime's MIS "mask" mode: tokens whose train/rollout
    ratio leaves [0.8, 1.25] are rejected (mask 0), the others weighted by the ratio."""
    ratio = torch.exp(old_logp - rollout_logp)
    keep = ((ratio >= 0.8) & (ratio <= 1.25)).to(mask.dtype)
    return pg * ratio, mask * keep, {"custom_ratio": ratio}


def _slime_policy_loss_with_rejection(logp, old, adv, masks, ent, ref, roll, cfg):
    """slime 624b824's ``policy_loss_function`` (loss.py) written out on per-sample lists, without
    per-token loss: the TIS function returns masks, ``sum_of_sample_mean`` is rebuilt with them for
    the numerators over the original per-sample denominators (``rollout_mask_sums``), and every
    loss term and metric but the TIS function's own goes through the rebuilt reducer."""
    n = len(masks)
    denoms = [m.sum() for m in masks]
    old_c, logp_c, roll_c = torch.cat(old), torch.cat(logp), torch.cat(roll)
    ppo_kl = old_c - logp_c
    ratio = torch.exp(-ppo_kl)
    a = torch.cat(adv)
    pg1, pg2 = -a * ratio, -a * ratio.clamp(1 - cfg.eps_clip, 1 + cfg.eps_clip_high)
    pg, clipfrac = torch.maximum(pg1, pg2), (pg2 > pg1).to(a.dtype)
    pg, new_masks, tis_metrics = _rejecting_tis(pg, old_c, roll_c, torch.cat(masks), None, n)
    lens = [len(m) for m in masks]
    new_masks = list(torch.split(new_masks, lens))

    def reducer(ms):
        return lambda x: sum((xi * mi).sum() / d.clamp(min=1) for xi, mi, d in zip(torch.split(x, lens), ms, denoms)) / n

    masked, original = reducer(new_masks), reducer(masks)
    entropy_loss = masked(torch.cat(ent))
    kl_loss = masked((torch.exp(torch.cat(ref) - logp_c) - 1 - (torch.cat(ref) - logp_c)).clamp(-10, 10))
    loss = masked(pg) - cfg.entropy_coef * entropy_loss + cfg.kl_coef * kl_loss
    metrics = {"pg_clipfrac": masked(clipfrac), "ppo_kl": masked(ppo_kl), "entropy": entropy_loss, "kl": kl_loss,
               "custom_ratio": original(tis_metrics["custom_ratio"]), "ois": original(torch.exp(-ppo_kl)),
               "train_rollout_logp_abs_diff": masked((old_c - roll_c).abs())}
    return loss, metrics


def test_a_rejecting_tis_function_masks_every_term_as_slime_does():
    """A custom TIS function that rejects tokens (slime's MIS "mask" mode) leaves them out of the
    policy-gradient term, the KL and entropy terms and their metrics, not only the first; its own
    metrics still count every loss token. slime's formulas (written out above) on the same fp64
    inputs; loss, gradient and metrics to 1e-12. (Checked once against slime 624b824's own
    ``policy_loss_function`` on these inputs: every metric equal, the loss 1.7e-10 apart because
    slime computes the KL in float32; and so was slime's own ``mis.py`` with its ``mis.yaml``
    through ``slime_compat``: its 23 metrics and the policy-gradient loss equal to 1e-16.)"""
    g = torch.Generator().manual_seed(7)
    lens = [4, 6, 3, 5]
    n = sum(lens)
    seq = torch.repeat_interleave(torch.arange(4), torch.tensor(lens))
    logp = (-torch.rand(n, generator=g, dtype=F64) * 2).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(n, generator=g, dtype=F64)
    ref = logp.detach() + 0.2 * torch.randn(n, generator=g, dtype=F64)
    roll = old + 0.3 * torch.randn(n, generator=g, dtype=F64)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=F64)[seq]
    mask = (torch.rand(n, generator=g) > 0.2).to(F64)
    ent = torch.rand(n, generator=g, dtype=F64)
    keep = (torch.exp(old - roll) >= 0.8) & (torch.exp(old - roll) <= 1.25)
    assert 0 < int((keep & (mask > 0)).sum()) < int(mask.sum())  # some loss tokens rejected, some kept
    cfg = LossConfig(eps_clip=0.2, eps_clip_high=0.28, loss_agg="seq_mean_token_mean", use_kl_loss=True,
                     kl_coef=0.05, kl_loss_type="low_var_kl", entropy_coef=0.01, use_tis=True)
    denom = LossDenominators.of_batch(mask, seq, 4)
    ours, stats = rl_loss(cfg, denom, logp, old, adv, mask, seq, 4, ent, ref, roll, torch.ones(n, dtype=F64),
                          importance=_rejecting_tis)
    (g_ours,) = torch.autograd.grad(ours, [logp])
    split = lambda t: list(torch.split(t, lens))  # noqa: E731
    logp2 = logp.detach().clone().requires_grad_()
    want, want_m = _slime_policy_loss_with_rejection(split(logp2), split(old), split(adv), split(mask), split(ent),
                                                     split(ref), split(roll), cfg)
    (g_want,) = torch.autograd.grad(want, [logp2])
    assert abs(float(ours - want)) < 1e-12
    assert float((g_ours - g_want).abs().max()) < 1e-12
    assert float(g_ours[~keep].abs().max()) == 0.0  # a rejected token gets no gradient from any term
    stats["train_rollout_logp_abs_diff"] = stats["train_rollout_logp_abs_diff"] / stats["_rollout_count"]  # step.py's
    for key in ("pg_clipfrac", "ppo_kl", "entropy", "kl", "custom_ratio", "ois", "train_rollout_logp_abs_diff"):
        assert abs(float(stats[key] - want_m[key])) < 1e-12, key


def test_rl_loss_tis_needs_rollout_log_probs():
    cfg = LossConfig(use_tis=True)
    x = torch.zeros(2)
    d = LossDenominators(2.0, 1.0, 2.0)
    with pytest.raises(ValueError, match="--use-tis"):
        rl_loss(cfg, d, x, x, x, torch.ones(2), torch.zeros(2, dtype=torch.long), 1, rollout_logp=x,
                rollout_mask=torch.tensor([1.0, 0.0]))


# --- the backends count the samples without loss tokens too ------------------------------------
def test_torch_backend_counts_samples_without_loss_tokens(toy_model_dir):
    # One optimizer step, so every ratio is 1 and each trained sample's pg loss is -A on every
    # token: train/pg_loss = -sum(A of the trained samples) / 16 under seq_mean_token_mean.
    from _fixtures_train import make_groups, settings

    from train_backend import create_backend

    groups = make_groups(toy_model_dir, num_groups=4, group_size=4)
    for g in groups:  # rewards that give every sample a non-zero advantage
        for i, s in enumerate(g):
            s.reward = float(i % 2) + 0.1 * i
    masked, empty = groups[1][1], groups[2][3]
    masked.loss_mask = [0] * masked.response_length
    empty.tokens, empty.response_length = empty.tokens[:empty.prompt_length], 0
    empty.loss_mask, empty.rollout_log_probs = [], []
    adv = compute_advantages(torch.tensor([[s.reward for s in g] for g in groups], dtype=F64), "grpo")  # [4, 4]
    trained = adv.sum() - adv[1, 1] - adv[2, 3]
    b = create_backend(settings(toy_model_dir, loss_agg="seq_mean_token_mean"))
    m = b.train_step(groups, 0)
    assert m["train/num_samples"] == 14 and m["train/skipped_zero_loss_mask"] == 1
    assert m["train/skipped_empty_response"] == 1
    assert m["train/pg_loss"] == pytest.approx(-trained.item() / 16, rel=1e-5)
    assert abs(trained.item() / 14 - trained.item() / 16) > 1e-3  # the two counts are told apart


# --- slime's own TIS functions by their slime path ------------------------------------------------
def _tis_inputs():
    g = torch.Generator().manual_seed(11)
    lens = [5, 3, 6]
    n = sum(lens)
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    logp = (-torch.rand(n, generator=g, dtype=F64) * 2).requires_grad_()
    old = logp.detach() + 0.05 * torch.randn(n, generator=g, dtype=F64)
    roll = old + 0.5 * torch.randn(n, generator=g, dtype=F64)
    adv = torch.tensor([1.0, -0.5, 0.25], dtype=F64)[seq]
    mask = (torch.rand(n, generator=g) > 0.15).to(F64)
    return logp, old, roll, adv, mask, seq


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_slimes_vanilla_tis_function_by_its_slime_path_equals_the_built_in_tis(agg):
    """``--custom-tis-function-path slime.backends.megatron_utils.loss.vanilla_tis_function`` (slime's
    default TIS, through the launcher's hook loading) gives the built-in ``--use-tis`` loss, gradient
    and TIS metrics, with both clip bounds (``--tis-clip-low``) active."""
    from train_backend.hooks import TrainHooks

    logp, old, roll, adv, mask, seq = _tis_inputs()
    w = torch.exp(old - roll)
    assert bool(((w < 0.7) & (mask > 0)).any()) and bool(((w > 1.4) & (mask > 0)).any())  # both bounds bite
    kw = dict(use_tis=True, tis_cap=1.4, tis_clip_low=0.7, loss_agg=agg)
    settings = TrainSettings(hf_checkpoint="m", custom_tis_function_path=
                             "slime.backends.megatron_utils.loss.vanilla_tis_function", **kw)
    importance = TrainHooks.load(settings).importance([8] * 3)
    cfg, denom, ones = LossConfig.from_settings(settings), LossDenominators.of_batch(mask, seq, 3), torch.ones_like(mask)
    out = []
    for fn in (None, importance):
        loss, stats = rl_loss(cfg, denom, logp, old, adv, mask, seq, 3, rollout_logp=roll, rollout_mask=ones,
                              importance=fn)
        out.append((loss, torch.autograd.grad(loss, [logp])[0], stats))
    (l0, g0, s0), (l1, g1, s1) = out
    assert float(l0) == pytest.approx(float(l1), abs=1e-15) and float((g0 - g1).abs().max()) < 1e-15
    for key in ("tis", "tis_abs", "tis_clipfrac"):
        assert float(s0[key]) == pytest.approx(float(s1[key]), abs=1e-15), key
    assert 0 < float(s0["tis_clipfrac"]) < 1


def test_slimes_icepop_function_by_its_slime_path_zeroes_the_tokens_outside_its_band():
    """slime's ``icepop_function``: a token whose train/rollout ratio leaves ``[--tis-clip-low,
    --tis-clip]`` gets weight 0 (no gradient) but still counts in the denominators; inside, the raw
    ratio. Against the formula on the same fp64 inputs."""
    from train_backend.hooks import TrainHooks

    logp, old, roll, adv, mask, seq = _tis_inputs()
    settings = TrainSettings(hf_checkpoint="m", use_tis=True, tis_cap=1.4, tis_clip_low=0.7, loss_agg="token_mean",
                             custom_tis_function_path="slime.backends.megatron_utils.loss.icepop_function")
    importance = TrainHooks.load(settings).importance([8] * 3)
    loss, stats = rl_loss(LossConfig.from_settings(settings), LossDenominators.of_batch(mask, seq, 3), logp, old,
                          adv, mask, seq, 3, rollout_logp=roll, rollout_mask=torch.ones_like(mask),
                          importance=importance)
    ratio = torch.exp(old - roll)
    inside = (ratio >= 0.7) & (ratio <= 1.4)
    pg, _ = policy_loss(logp - old, adv, 0.2)
    want = (pg * torch.where(inside, ratio, torch.zeros_like(ratio)) * mask).sum() / mask.sum()
    assert float(loss) == pytest.approx(float(want), abs=1e-15)
    (grad,) = torch.autograd.grad(loss, [logp])
    assert float(grad[~inside].abs().max()) == 0.0 and float(grad[inside & (mask > 0)].abs().min()) > 0
    assert float(stats["tis_clipfrac"]) == pytest.approx(float(((~inside).to(F64) * mask).sum() / mask.sum()))


def test_get_mismatch_metrics_alone_logs_tis_metrics_and_leaves_the_loss_unweighted():
    """``--get-mismatch-metrics`` without ``--use-tis``: the built-in TIS metrics (and slime's ``ois``)
    are logged, the loss and its gradient are those of no correction; a custom TIS function's
    result applies (slime's policy_loss_function calls it under either flag)."""
    logp, old, roll, adv, mask, seq = _tis_inputs()
    denom, ones = LossDenominators.of_batch(mask, seq, 3), torch.ones_like(mask)
    runs = {}
    for name, kw, fn in (("plain", {}, None), ("metrics", {"get_mismatch_metrics": True}, None),
                         ("tis", {"use_tis": True}, None), ("custom", {"get_mismatch_metrics": True}, _rejecting_tis)):
        loss, stats = rl_loss(LossConfig(tis_cap=1.4, **kw), denom, logp, old, adv, mask, seq, 3, rollout_logp=roll,
                              rollout_mask=ones, importance=fn)
        runs[name] = (float(loss), torch.autograd.grad(loss, [logp])[0], stats)
    assert runs["metrics"][0] == runs["plain"][0] and torch.equal(runs["metrics"][1], runs["plain"][1])
    assert "tis" not in runs["plain"][2] and "tis_weight" not in runs["metrics"][2]  # no weight was applied
    for key in ("tis", "tis_abs", "tis_clipfrac", "ois"):
        assert float(runs["metrics"][2][key]) == float(runs["tis"][2][key]), key
    assert runs["tis"][0] != runs["plain"][0] and runs["custom"][0] != runs["plain"][0]
    assert "custom_ratio" in runs["custom"][2]
