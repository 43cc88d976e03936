"""The built-in mismatch corrections and CISPO (train_backend/mismatch.py, losses.cispo_loss) against
slime 624b824's own code on the same float64 inputs, to 1e-12:

- ``--tis-function mis`` vs ``examples/train_infer_mismatch_helper/mis.py``'s
  ``compute_mis_weights_with_cp`` (weights applied to the policy loss, masks, every metric), for
  every level, mode, rejection level, veto and batch normalisation;
- ``--tis-function icepop`` vs ``slime/backends/megatron_utils/loss.py``'s ``icepop_function``;
- ``--advantage-estimator cispo`` vs ``slime/utils/ppo_utils.py``'s ``compute_cispo_loss`` reduced
  as ``policy_loss_function`` reduces it (loss and gradient), and slime's tests/test_cispo_loss.py
  cases.

slime's own files are run when its mirror is on this machine (``SLIME_MIRROR``, default
/work/.mirror/THUDM+slime/repo: ``mis.py`` unchanged through slime_compat, the two functions cut out
of their modules with ``ast``, whose other imports need Megatron); CI has no mirror, so each check
also runs against a written-out reference that says which slime lines it follows (the mirror runs
check those references too).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from train_backend.losses import LossConfig, LossDenominators, cispo_loss, rl_loss
from train_backend.mismatch import MisConfig, builtin_importance, icepop_is, mis_is
from train_backend.settings import TrainSettings

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]
MIRROR = Path(os.environ.get("SLIME_MIRROR", "/work/.mirror/THUDM+slime/repo"))


def _slime_source(path: str) -> str | None:
    """slime's file at the mirrored commit, or None without the mirror."""
    if not MIRROR.exists():
        return None
    out = subprocess.run(["git", "-C", str(MIRROR), "show", f"HEAD:{path}"], capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None


def _slime_function(path: str, name: str):
    """Function ``name`` of slime's ``path``, cut out with ``ast`` (decorators dropped: slime's
    ``@torch.compile`` changes no value) and run on its own; None without the mirror."""
    src = _slime_source(path)
    if src is None:
        return None
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []
    ns: dict = {"torch": torch, "Any": object}
    exec(compile(ast.Module([node], []), f"slime:{path}", "exec"), ns)
    return ns[name]


def _slime_mis_module():
    """slime's mis.py, unchanged, imported with slime_compat answering its ``slime.*`` import."""
    src = _slime_source("examples/train_infer_mismatch_helper/mis.py")
    if src is None:
        return None
    import slime_compat

    slime_compat.install()
    mod = types.ModuleType("slime_mis")
    exec(compile(src, "slime:examples/train_infer_mismatch_helper/mis.py", "exec"), mod.__dict__)
    return mod


def _inputs(seed: int = 3):
    """Five sequences (one of a single token), some loss tokens masked, one sequence masked whole,
    one catastrophic token (trainer far below the engine), a spread of ratios around 1."""
    g = torch.Generator().manual_seed(seed)
    lens = [5, 1, 7, 4, 6]
    n, s = sum(lens), len(lens)
    seq = torch.repeat_interleave(torch.arange(s), torch.tensor(lens))
    old = -torch.rand(n, generator=g, dtype=F64) * 2
    roll = old + 0.4 * torch.randn(n, generator=g, dtype=F64)
    roll[3] = old[3] + 12.0  # ratio e^-12 < the veto threshold
    mask = (torch.rand(n, generator=g) > 0.2).to(F64)
    mask[5] = 0.0  # the one-token sequence has no loss token
    pg = torch.randn(n, generator=g, dtype=F64)
    return pg, old, roll, mask, seq, lens


# --- MIS: a written-out reference of slime's mis.py ------------------------------------------------
def _ref_compute_mis_weights(args, train, rollout, masks):
    """mis.py's ``compute_mis_weights`` (lines 133-296 at 624b824) with its helpers
    (``truncate``/``clip``/``mask``/``calculate_veto_mask``/``add_ppl_metrics``), per sequence as slime
    loops; ``metrics`` maps each name to its per-sequence tensors."""
    metrics: dict[str, list] = {}

    def put(key, value):
        metrics.setdefault(key, []).append(value.clone().detach())

    def msum(x, m):
        return (x * m).sum()

    def mmean(x, m):
        return msum(x, m) / torch.clamp_min(m.sum(), 1)

    def level_log_ratio(d, m, level):
        return {"token": d, "sequence": msum(d, m).expand_as(d), "geometric": mmean(d, m).expand_as(d)}[level]

    for t, r, m in zip(train, rollout, masks):  # add_ppl_metrics
        m = m.float().to(F64)
        tm, rm = mmean(t, m), mmean(r, m)
        put("training_log_ppl", (-tm).expand_as(t)), put("training_ppl", torch.exp(-tm).expand_as(t))
        put("rollout_log_ppl", (-rm).expand_as(t)), put("rollout_ppl", torch.exp(-rm).expand_as(t))
        lr = t - r
        put("kl", r - t), put("k3_kl", torch.exp(lr) - lr - 1)
        d = (rm - tm).expand_as(t)
        put("log_ppl_diff", d), put("log_ppl_abs_diff", d.abs()), put("ppl_ratio", torch.exp(d))
        rho = torch.exp(lr.clamp(-20, 20))
        put("chi2_token", (mmean(rho * rho, m) - 1.0).expand_as(t))
        put("chi2_seq", torch.exp(2.0 * msum(lr, m).expand_as(t).clamp(-20, 20)) - 1.0)
    if not args.use_tis:
        return None, masks, metrics
    upper = args.tis_upper_bound
    lower = args.tis_lower_bound if args.tis_lower_bound is not None else 1.0 / upper
    rs_lower = args.rs_lower_bound if args.rs_lower_bound is not None else lower
    rs_upper = args.rs_upper_bound if args.rs_upper_bound is not None else upper
    weights, new_masks = [], []
    for t, r, m in zip(train, rollout, masks):
        m = m.float().to(F64)
        diff = t - r
        keep = m.clone()
        lt = level_log_ratio(diff, m, args.tis_level)
        w = torch.exp(lt.clamp(-20, 20))
        put("tis_weight_before_bound", w)
        if args.tis_mode == "truncate":
            put("tis_truncate_fraction", (w > upper).int())
            w = w.clamp(0, upper) * m
        elif args.tis_mode == "clip":
            put("tis_clip_fraction_low", (w < lower).int()), put("tis_clip_fraction_high", (w > upper).int())
            w = w.clamp(lower, upper) * m
        else:
            put("tis_mask_fraction_low", (w < lower).int()), put("tis_mask_fraction_high", (w > upper).int())
            keep = m * ((w >= lower) & (w <= upper)).float()
            w = w * m
        put("tis_weight_after_bound", w)
        if args.use_rs:
            rw = torch.exp((lt if args.rs_level == args.tis_level else level_log_ratio(diff, m, args.rs_level))
                           .clamp(-20, 20))
            put("rs_mask_fraction_low", (rw < rs_lower).int()), put("rs_mask_fraction_high", (rw > rs_upper).int())
            keep = keep * ((rw >= rs_lower) & (rw <= rs_upper)).float()
            if args.rs_veto_threshold is not None:
                bad = (diff < torch.log(torch.tensor(args.rs_veto_threshold))) & m.bool()
                put("rs_catastrophic_token_fraction", bad.int())
                put("rs_catastrophic_seq_fraction", bad.any().int().expand_as(m))
                keep = keep * (~bad.any()).float().expand_as(diff)
        put("is_ratio_mean_after_tis_rs", w)
        weights.append(w)
        new_masks.append(keep)
    if args.tis_batch_normalize:
        if args.tis_level == "token":
            mean = sum(msum(w, m) for w, m in zip(weights, masks)) / torch.clamp_min(sum(m.sum() for m in masks), 1)
        else:
            mean = sum(mmean(w, m) for w, m in zip(weights, masks)) / len(weights)
        if mean > 1e-8:
            weights = [w / mean for w in weights]
        for w in weights:
            put("batch_norm_factor", mean.expand_as(w) if mean > 1e-8 else torch.ones_like(w))
    for w, m in zip(weights, masks):
        m = m.float().to(F64)
        put("is_ratio_mean_final", mmean(w, m).expand_as(w))
        for key, fn in (("is_ratio_min_final", torch.min), ("is_ratio_max_final", torch.max)):
            put(key, (fn(w[m.bool()]) if m.bool().any() else torch.tensor(0.0, dtype=w.dtype)).expand_as(w))
    return weights, new_masks, metrics


def _ref_mis_with_cp(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **_):
    """mis.py's ``compute_mis_weights_with_cp`` (lines 299-361) with one context-parallel rank."""
    w, masks, metrics = _ref_compute_mis_weights(args, train_log_probs, rollout_log_probs, loss_masks)
    if w is not None:
        pg_loss = pg_loss * torch.cat(w)
    return pg_loss, masks, {f"mis_{k}": torch.cat(v) for k, v in metrics.items()}


def _mis_configs():
    """Every level x mode, with and without rejection (at each level, with the veto), batch
    normalisation at the levels mis.py allows it, and metrics alone (use_tis False)."""
    for level, mode in itertools.product(("token", "sequence", "geometric"), ("truncate", "clip", "mask")):
        # mis.yaml: "For Geometry level, the upper bound should be 1.0001"
        upper = 1.0001 if level == "geometric" else 2.0
        lower = 0.9999 if level == "geometric" else (0.5 if mode == "clip" else None)
        yield MisConfig(tis_level=level, tis_mode=mode, tis_lower_bound=lower, tis_upper_bound=upper)
        for rs_level in ("token", "sequence", "geometric"):
            yield MisConfig(tis_level=level, tis_mode=mode, tis_lower_bound=lower, tis_upper_bound=upper,
                            use_rs=True, rs_level=rs_level, rs_veto_threshold=1e-4)
        if level != "geometric":
            yield MisConfig(tis_level=level, tis_mode=mode, tis_lower_bound=lower, tis_upper_bound=upper,
                            use_rs=True, rs_lower_bound=0.7, rs_upper_bound=1.5, tis_batch_normalize=True)
    yield MisConfig(use_tis=False)


def _mis_oracles():
    slime = _slime_mis_module()
    yield pytest.param(_ref_mis_with_cp, id="written-out")
    yield pytest.param(None if slime is None else slime.compute_mis_weights_with_cp, id="slime-mis.py",
                       marks=pytest.mark.skipif(slime is None, reason="no slime mirror on this machine"))


def _assert_same(got, want, what: str) -> float:
    worst = float((got.to(F64) - want.to(F64)).abs().max()) if got.numel() else 0.0
    assert worst <= 1e-12, f"{what}: {worst}"
    return worst


@pytest.mark.parametrize("oracle", list(_mis_oracles()))
def test_builtin_mis_equals_slimes_mis_py_for_every_level_and_mode(oracle):
    """``--tis-function mis``'s policy loss, kept-token masks and every ``mis_*`` metric per token
    equal slime's ``compute_mis_weights_with_cp`` (mis.yaml's keys as ``args``) to 1e-12 in float64,
    for each configuration of :func:`_mis_configs`; the inputs make every bound, the veto and the
    masking bite somewhere (checked below, so a weak input cannot pass silently)."""
    pg, old, roll, mask, seq, lens = _inputs()
    split = lambda t: list(torch.split(t, lens))  # noqa: E731
    bit = {"mask": 0, "veto": 0, "truncate": 0}
    for cfg in _mis_configs():
        args = argparse.Namespace(**cfg.__dict__)
        want_pg, want_masks, want_metrics = oracle(args, pg_loss=pg, train_log_probs=split(old),
                                                   rollout_log_probs=split(roll), loss_masks=split(mask),
                                                   total_lengths=[x + 3 for x in lens], response_lengths=lens)
        got_pg, got_mask, got_metrics = mis_is(pg, old, roll, mask, seq, len(lens), cfg)
        _assert_same(got_pg, want_pg, f"{cfg} pg")
        _assert_same(got_mask, torch.cat([m.to(F64) for m in want_masks]), f"{cfg} mask")
        assert set(got_metrics) == set(want_metrics), (cfg, set(got_metrics) ^ set(want_metrics))
        for key in want_metrics:
            _assert_same(got_metrics[key], want_metrics[key], f"{cfg} {key}")
        bit["mask"] += int(bool((got_mask < mask).any()))
        bit["veto"] += int(float(got_metrics.get("mis_rs_catastrophic_seq_fraction", torch.zeros(1)).max()) > 0)
        bit["truncate"] += int(float(got_metrics.get("mis_tis_truncate_fraction", torch.zeros(1)).max()) > 0)
    assert all(v > 0 for v in bit.values()), bit


def test_builtin_mis_in_the_loss_leaves_rejected_tokens_out_of_every_term():
    """Through rl_loss, ``--tis-function mis --tis-mode mask --use-rs`` gives the loss and gradient of
    slime's mis.py run as ``--custom-tis-function-path`` (here the written-out reference through the
    hook loader's contract), and a rejected token gets no gradient from any term."""
    from train_backend.hooks import TrainHooks

    pg_unused, old, roll, mask, seq, lens = _inputs()
    logp = (old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
            ).requires_grad_()
    ref = old - 0.1
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0], dtype=F64)[seq]
    kw = dict(use_tis=True, tis_mode="mask", tis_upper_bound=1.5, use_rs=True, rs_veto_threshold=1e-4,
              loss_agg="seq_mean_token_mean", use_kl_loss=True, kl_coef=0.1, kl_loss_type="low_var_kl")
    builtin = TrainSettings(hf_checkpoint="m", tis_function="mis", **kw)
    custom = TrainSettings(hf_checkpoint="m", custom_tis_function_path="test_train_mismatch._ref_mis_with_cp", **kw)
    denom = LossDenominators.of_batch(mask, seq, len(lens))
    out = []
    for s, fn in ((builtin, builtin_importance(builtin)), (custom, TrainHooks.load(custom).importance([9] * 5))):
        assert fn is not None
        loss, stats = rl_loss(LossConfig.from_settings(s), denom, logp, old, adv, mask, seq, len(lens), ref_logp=ref,
                              rollout_logp=roll, rollout_mask=torch.ones_like(mask), importance=fn)
        out.append((loss, torch.autograd.grad(loss, [logp])[0], stats))
    (l0, g0, s0), (l1, g1, s1) = out
    assert abs(float((l0 - l1).detach())) <= 1e-12 and float((g0 - g1).abs().max()) <= 1e-12
    for key in s1:
        assert abs(float(s0[key] - s1[key])) <= 1e-12, key
    _, keep, _ = mis_is(torch.zeros_like(old), old, roll, mask, seq, len(lens), MisConfig.from_settings(builtin))
    rejected = (mask > 0) & (keep == 0)
    assert bool(rejected.any()) and float(g0[rejected].abs().max()) == 0.0
    assert float(s0["mis_rs_catastrophic_seq_fraction"]) > 0


# --- IcePop ------------------------------------------------------------------------------------------
def _ref_icepop_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **_):
    """slime's ``icepop_function`` (slime/backends/megatron_utils/loss.py lines 908-931 at 624b824)."""
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    w = torch.where((ratio >= args.tis_clip_low) & (ratio <= args.tis_clip), ratio, torch.zeros_like(ratio))
    return pg_loss * w, loss_masks, {"tis": ratio, "tis_clipfrac": (w != ratio).float(), "tis_abs": (ratio - 1).abs()}


def _icepop_oracles():
    slime = _slime_function("slime/backends/megatron_utils/loss.py", "icepop_function")
    yield pytest.param(_ref_icepop_function, id="written-out")
    yield pytest.param(slime, id="slime-loss.py", marks=pytest.mark.skipif(slime is None, reason="no slime mirror"))


@pytest.mark.parametrize("oracle", list(_icepop_oracles()))
def test_builtin_icepop_equals_slimes_icepop_function(oracle):
    """``--tis-function icepop`` equals slime's ``icepop_function`` per token (policy loss, masks,
    ``tis``/``tis_abs``/``tis_clipfrac``) in float64, with both bounds biting; and through rl_loss
    its loss and gradient equal ``--custom-tis-function-path slime.backends.megatron_utils.loss.
    icepop_function`` (slime_compat's path)."""
    from train_backend.hooks import TrainHooks

    pg, old, roll, mask, seq, lens = _inputs(5)
    ratio = torch.exp(old - roll)
    assert bool(((ratio < 0.7) & (mask > 0)).any()) and bool(((ratio > 1.4) & (mask > 0)).any())
    args = argparse.Namespace(tis_clip=1.4, tis_clip_low=0.7)
    split = lambda t: list(torch.split(t, lens))  # noqa: E731
    want_pg, want_masks, want_m = oracle(args, pg_loss=pg, train_log_probs=split(old), rollout_log_probs=split(roll),
                                         loss_masks=split(mask))
    got_pg, got_mask, got_m = icepop_is(pg, old, roll, mask, seq, len(lens), 1.4, 0.7)
    _assert_same(got_pg, want_pg, "pg")
    assert torch.equal(got_mask, torch.cat(want_masks)) and set(got_m) == set(want_m)
    for key in want_m:
        _assert_same(got_m[key], want_m[key], key)

    logp = (old + 0.05).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0], dtype=F64)[seq]
    denom = LossDenominators.of_batch(mask, seq, len(lens))
    kw = dict(hf_checkpoint="m", use_tis=True, tis_cap=1.4, tis_clip_low=0.7)
    builtin = TrainSettings(tis_function="icepop", **kw)
    compat = TrainSettings(custom_tis_function_path="slime.backends.megatron_utils.loss.icepop_function", **kw)
    runs = []
    for s, fn in ((builtin, builtin_importance(builtin)), (compat, TrainHooks.load(compat).importance([9] * 5))):
        loss, stats = rl_loss(LossConfig.from_settings(s), denom, logp, old, adv, mask, seq, len(lens),
                              rollout_logp=roll, rollout_mask=torch.ones_like(mask), importance=fn)
        runs.append((loss, torch.autograd.grad(loss, [logp])[0], stats))
    assert abs(float((runs[0][0] - runs[1][0]).detach())) <= 1e-12 and float((runs[0][1] - runs[1][1]).abs().max()) <= 1e-12
    outside = (ratio < 0.7) | (ratio > 1.4)
    assert float(runs[0][1][outside].abs().max()) == 0.0 and float(runs[0][1][~outside & (mask > 0)].abs().min()) > 0


def test_builtin_corrections_with_get_mismatch_metrics_alone_leave_the_loss_as_it_is():
    """``--get-mismatch-metrics`` without ``--use-tis``: icepop and mis log their metrics (mis: the gap
    metrics only, as mis.py) and the loss and gradient are those of no correction."""
    _, old, roll, mask, seq, lens = _inputs()
    logp = (old + 0.05).requires_grad_()
    adv = torch.ones_like(old)
    denom = LossDenominators.of_batch(mask, seq, len(lens))

    def run(**kw):
        s = TrainSettings(hf_checkpoint="m", **kw)
        loss, stats = rl_loss(LossConfig.from_settings(s), denom, logp, old, adv, mask, seq, len(lens),
                              rollout_logp=roll, rollout_mask=torch.ones_like(mask), importance=builtin_importance(s))
        return loss.detach(), torch.autograd.grad(loss, [logp])[0], stats

    plain = run()
    for fn in ("icepop", "mis"):
        loss, grad, stats = run(tis_function=fn, get_mismatch_metrics=True)
        assert float(loss) == float(plain[0]) and torch.equal(grad, plain[1]), fn
        assert ("tis_clipfrac" in stats) if fn == "icepop" else ("mis_k3_kl" in stats and
                                                                 "mis_tis_weight_after_bound" not in stats)
        applied = run(tis_function=fn, use_tis=True)
        assert float(applied[0]) != float(plain[0]), fn


# --- CISPO -------------------------------------------------------------------------------------------
def _ref_compute_cispo_loss(ppo_kl, log_probs, advantages, eps_clip, eps_clip_high):
    """slime's ``compute_cispo_loss`` (slime/utils/ppo_utils.py lines 152-171 at 624b824)."""
    ratio = (-ppo_kl).exp()
    w = torch.clamp(ratio, min=1.0 - eps_clip, max=1.0 + eps_clip_high)
    return -w.detach() * advantages * log_probs, (w != ratio).float()


def _cispo_oracles():
    slime = _slime_function("slime/utils/ppo_utils.py", "compute_cispo_loss")
    yield pytest.param(_ref_compute_cispo_loss, id="written-out")
    yield pytest.param(slime, id="slime-ppo_utils.py", marks=pytest.mark.skipif(slime is None, reason="no mirror"))


@pytest.mark.parametrize("oracle", list(_cispo_oracles()))
@pytest.mark.parametrize("eps_clip, eps_clip_high", [(0.2, 0.28), (1.0, 4.0)])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_cispo_loss_and_gradient_equal_slimes(oracle, eps_clip, eps_clip_high, agg):
    """``--advantage-estimator cispo``: rl_loss's loss, gradient and clip fraction equal slime's
    ``policy_loss_function`` cispo branch (``compute_cispo_loss`` on ``ppo_kl = old - logp``, reduced
    by ``sum_of_sample_mean``) to 1e-12 in float64; clipped tokens keep a gradient (``-w A``) where
    PPO's clip zeroes it."""
    g = torch.Generator().manual_seed(9)
    lens = [4, 6, 3]
    n = sum(lens)
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    old = -torch.rand(n, generator=g, dtype=F64) * 2
    logp = (old + 1.5 * torch.randn(n, generator=g, dtype=F64)).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=F64)[seq]
    mask = (torch.rand(n, generator=g) > 0.15).to(F64)
    s = TrainSettings(hf_checkpoint="m", advantage_estimator="cispo", eps_clip=eps_clip, eps_clip_high=eps_clip_high,
                      loss_agg=agg)
    cfg = LossConfig.from_settings(s)
    assert cfg.cispo
    loss, stats = rl_loss(cfg, LossDenominators.of_batch(mask, seq, 3), logp, old, adv, mask, seq, 3)
    (grad,) = torch.autograd.grad(loss, [logp])

    logp2 = logp.detach().clone().requires_grad_()
    pg, clipfrac = oracle(old - logp2, logp2, adv, eps_clip, eps_clip_high)
    if agg == "token_mean":  # slime's sum_of_sample_mean with calculate_per_token_loss
        reduce = lambda x: (x * mask).sum() / mask.sum()  # noqa: E731
    else:
        reduce = lambda x: sum((xs * ms).sum() / ms.sum() for xs, ms in  # noqa: E731
                               zip(torch.split(x, lens), torch.split(mask, lens))) / 3
    want = reduce(pg)
    (want_grad,) = torch.autograd.grad(want, [logp2])
    assert abs(float((loss - want).detach())) <= 1e-12 and float((grad - want_grad).abs().max()) <= 1e-12
    assert abs(float(stats["pg_clipfrac"] - reduce(clipfrac))) <= 1e-12
    ratio = torch.exp(logp.detach() - old)
    clipped = ((ratio < 1 - eps_clip) | (ratio > 1 + eps_clip_high)) & (mask > 0)
    assert bool(clipped.any()) and float(grad[clipped].abs().min()) > 0  # PPO would give these 0


@pytest.mark.parametrize("eps_clip, eps_clip_high, ratios, clamped", [
    (0.2, 0.28, [1.0, 1.14, 1.56, 0.4], [1.0, 1.14, 1.28, 0.8]),
    (1.0, 4.0, [1.0, 3.0, 9.0, 0.4], [1.0, 3.0, 5.0, 0.4])])
def test_cispo_loss_on_slimes_own_test_cases(eps_clip, eps_clip_high, ratios, clamped):
    """slime's tests/test_cispo_loss.py cases: the closed form ``-clamped * A * logp``, the gradient
    ``-clamped * A`` through the log-probs only, none through the ratio."""
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=F64)
    logp = torch.tensor([-0.7, -1.2, -0.4, -2.1], dtype=F64, requires_grad=True)
    log_ratio = torch.tensor([math.log(r) for r in ratios], dtype=F64, requires_grad=True)
    loss, clipped = cispo_loss(log_ratio, logp, adv, eps_clip, eps_clip_high)
    c = torch.tensor(clamped, dtype=F64)
    torch.testing.assert_close(loss, -c * adv * logp.detach(), rtol=1e-12, atol=1e-12)
    assert clipped.tolist() == [float(a != b) for a, b in zip(clamped, ratios)]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, -c * adv, rtol=1e-12, atol=1e-12)
    assert log_ratio.grad is None or bool((log_ratio.grad == 0).all())


# --- flags -------------------------------------------------------------------------------------------
def _base_argv(model) -> list[str]:
    return ["--config", str(ROOT / "examples/toy/grpo_cpu.yaml"), "--hf-checkpoint", str(model),
            "--prompt-data", str(model / "data/train.jsonl"), "--eval-prompt-data", str(model / "data/eval.jsonl")]


@pytest.mark.parametrize("kw, msg", [
    (dict(tis_function="icepop"), "--tis-function icepop is only applied with --use-tis"),
    (dict(use_tis=True, tis_mode="mask"), "--tis-mode configure --tis-function mis"),
    (dict(use_tis=True, tis_function="mis", rs_veto_threshold=1e-4), "have no effect without --use-rs"),
    (dict(get_mismatch_metrics=True, tis_function="mis", use_rs=True), "--use-rs rejects tokens only with --use-tis"),
    (dict(use_tis=True, tis_function="mis", tis_level="geometric", tis_batch_normalize=True),
     "--tis-batch-normalize needs --tis-level token or sequence"),
    (dict(use_tis=True, tis_function="mis", tis_mode="clip", tis_lower_bound=3.0), "--tis-lower-bound=3.0 must be"),
    (dict(use_tis=True, tis_function="icepop", custom_tis_function_path="x.y"), "both choose the TIS function"),
    (dict(advantage_estimator="cispo", eps_clip_c=3.0), "--eps-clip-c is PPO's dual clip"),
])
def test_a_bad_combination_of_mismatch_flags_is_one_line_naming_them(kw, msg, toy_model_dir):
    from flags import from_args

    sys.path.insert(0, str(ROOT / "scripts"))
    from scripts.arguments import parse_args

    args = parse_args(_base_argv(toy_model_dir))
    for k, v in kw.items():
        setattr(args, k, v)
    with pytest.raises(ValueError) as e:
        from_args(TrainSettings, args)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_cispo_takes_its_one_sided_clip_and_grpos_advantages():
    from train_backend.losses import compute_advantages

    s = TrainSettings(hf_checkpoint="m", advantage_estimator="cispo", eps_clip=1.0, eps_clip_high=4.0)
    assert s.eps_clip == 1.0
    r = torch.tensor([[1.0, 0.0, 1.0, 0.5]], dtype=F64)
    assert torch.equal(compute_advantages(r, "cispo"), compute_advantages(r, "grpo"))


def test_slimes_mis_yaml_sets_the_mis_flags_and_runs_with_the_builtin_or_mis_py(toy_model_dir, tmp_path, capsys):
    """slime's mis.yaml (its keys, as shipped at 624b824) through ``--custom-config-path``: its keys set
    the flags left at their defaults, so ``--tis-function mis`` trains with them and slime's mis.py as
    ``--custom-tis-function-path`` reads the same values; a flag given another value stays refused."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from scripts.arguments import parse_args

    from train_backend.arguments import settings_from_args

    yaml_text = ("use_tis: true\nuse_rs: true\ntis_level: \"token\"\nrs_level: \"token\"\ntis_mode: \"truncate\"\n"
                 "tis_lower_bound: 0.5\ntis_upper_bound: 2.0\nrs_lower_bound: null\nrs_upper_bound: null\n"
                 "rs_veto_threshold: 1.0e-4\ntis_batch_normalize: true\n")
    cfg = tmp_path / "mis.yaml"
    cfg.write_text(yaml_text)
    base = [*_base_argv(toy_model_dir), "--use-tis", "--custom-config-path", str(cfg)]
    s = settings_from_args(parse_args([*base, "--tis-function", "mis"]))
    assert (s.use_rs, s.tis_lower_bound, s.rs_veto_threshold, s.tis_batch_normalize) == (True, 0.5, 1e-4, True)
    assert builtin_importance(s) is not None
    s = settings_from_args(parse_args([*base, "--custom-tis-function-path", "x.compute_mis_weights_with_cp"]))
    assert s.plugin_args["use_rs"] is True and s.plugin_args["rs_veto_threshold"] == 1e-4
    with pytest.raises(SystemExit):
        parse_args([*base, "--tis-function", "mis", "--tis-upper-bound", "3"])
    assert "key 'tis_upper_bound' = 2.0 is the flag --tis-upper-bound" in capsys.readouterr().err


def test_train_step_logs_the_mis_metrics(toy_model_dir):
    """A torch-backend train step with ``--tis-function mis`` logs mis.py's metrics under
    ``train/mis_*`` (a built-in's own names are gathered like a plugin's)."""
    from _fixtures_train import make_groups, settings

    from train_backend import create_backend

    groups = make_groups(toy_model_dir, num_groups=2, group_size=4, logp_noise=0.3)
    b = create_backend(settings(toy_model_dir, use_tis=True, tis_function="mis", tis_mode="mask",
                                       tis_upper_bound=1.2, use_rs=True))
    m = b.train_step(groups, 0)
    assert m["train/mis_tis_mask_fraction_high"] > 0 and "train/mis_chi2_seq" in m and "train/pg_loss" in m
