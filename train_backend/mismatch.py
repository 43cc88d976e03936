"""The built-in train/rollout mismatch corrections beside the truncated IS of ``--use-tis``
(:func:`train_backend.losses.truncated_is`), chosen with ``--tis-function``:

- ``icepop`` (:func:`icepop_is`): slime's ``icepop_function``; a token whose train/rollout ratio
  leaves ``[--tis-clip-low, --tis-clip]`` is weighted 0, the others by the ratio.
- ``mis`` (:func:`mis_is`): slime's ``examples/train_infer_mismatch_helper/mis.py``
  (``compute_mis_weights_with_cp``, configured by its ``mis.yaml`` keys, which are flags here:
  ``--tis-level``, ``--tis-mode``, ``--tis-lower-bound``, ``--tis-upper-bound``, ``--use-rs``,
  ``--rs-level``, ``--rs-lower-bound``, ``--rs-upper-bound``, ``--rs-veto-threshold``,
  ``--tis-batch-normalize``): token-, sequence- (product) or geometric-mean-level weights,
  truncated, clipped or masked, plus rejection sampling with a per-token veto, and the
  perplexity / KL / chi-square gap metrics.

Each is an :data:`~train_backend.losses.ImportanceFn` over one micro-batch's flat ``[N]`` tensors
(``seq_ids`` gives each token's sequence), as slime calls its TIS functions once per micro-batch.
With ``--get-mismatch-metrics`` and no ``--use-tis`` they log their metrics and leave the loss as it
is (slime's README: "will only return mismatch metrics but not change the loss in any way").
docs/mismatch.md says which to use when and which test checks each against which slime code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from train_backend.losses import ImportanceFn, segment_sum
from train_backend.settings import TrainSettings

# mis.py's bound on a log-ratio before exp (its SAFETY_BOUND): no overflow for a long sequence
_SAFETY_BOUND = 20.0


def icepop_is(pg: Tensor, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, seq_ids: Tensor, num_seqs: int,
              cap: float, low: float, apply: bool = True) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """IcePop: ``pg`` times ``ratio = exp(old_logp - rollout_logp)`` where ``low <= ratio <= cap``,
    times 0 elsewhere (the token keeps its place in the denominators: the mask is returned as it
    came). Stats per token as slime's: ``tis`` (the ratio), ``tis_abs`` (``|ratio - 1|``),
    ``tis_clipfrac`` (1 where the weight is not the ratio). ``apply=False``: the stats alone."""
    ratio = torch.exp(old_logp - rollout_logp).detach()  # [N]
    inside = (ratio >= low) & (ratio <= cap)  # [N]
    w = torch.where(inside, ratio, torch.zeros_like(ratio))  # [N]
    stats = {"tis": ratio, "tis_abs": (ratio - 1).abs(), "tis_clipfrac": (w != ratio).to(mask.dtype)}
    return (pg * w if apply else pg), mask, stats


@dataclass(frozen=True)
class MisConfig:
    """``--tis-function mis``'s settings, under mis.yaml's names (``None`` bounds: mis.py's
    fallbacks, ``1 / tis_upper_bound`` and the TIS bounds for rejection)."""

    use_tis: bool = True  # False (--get-mismatch-metrics alone): the gap metrics only
    tis_level: str = "token"  # token, sequence (product of the ratios) or geometric (their mean)
    tis_mode: str = "truncate"  # truncate (cap), clip (both bounds) or mask (reject outside)
    tis_lower_bound: float | None = None
    tis_upper_bound: float = 2.0
    use_rs: bool = False
    rs_level: str = "token"
    rs_lower_bound: float | None = None
    rs_upper_bound: float | None = None
    rs_veto_threshold: float | None = None
    tis_batch_normalize: bool = False

    @classmethod
    def from_settings(cls, s: TrainSettings) -> "MisConfig":
        return cls(s.use_tis, s.tis_level, s.tis_mode, s.tis_lower_bound, s.tis_upper_bound, s.use_rs, s.rs_level,
                   s.rs_lower_bound, s.rs_upper_bound, s.rs_veto_threshold, s.tis_batch_normalize)


def _seq_mean(x: Tensor, m: Tensor, seq_ids: Tensor, num_seqs: int) -> Tensor:
    """Each sequence's mean of ``x`` over ``m``'s tokens (0 for none), per sequence ``[S]``."""
    return segment_sum(x * m, seq_ids, num_seqs) / segment_sum(m, seq_ids, num_seqs).clamp(min=1)


def _level_log_ratio(diff: Tensor, m: Tensor, seq_ids: Tensor, num_seqs: int, level: str) -> Tensor:
    """The log importance ratio at ``level``, per token ``[N]``: the token's own; the sum over its
    sequence's loss tokens (the sequence's ratio is the product); or their mean (geometric)."""
    if level == "token":
        return diff
    if level == "sequence":
        return segment_sum(diff * m, seq_ids, num_seqs)[seq_ids]
    if level == "geometric":
        return _seq_mean(diff, m, seq_ids, num_seqs)[seq_ids]
    raise ValueError(f"--tis-level/--rs-level {level!r}: expected token, sequence or geometric")


def _seq_extreme(x: Tensor, m: Tensor, seq_ids: Tensor, num_seqs: int, largest: bool) -> Tensor:
    """Each sequence's min (max) of ``x`` over ``m``'s tokens, 0 for a sequence with none, ``[N]``."""
    fill = torch.full_like(x, -math.inf if largest else math.inf)
    vals = torch.where(m > 0, x, fill)  # [N]
    init = torch.full((num_seqs,), -math.inf if largest else math.inf, dtype=x.dtype, device=x.device)
    out = init.scatter_reduce(0, seq_ids, vals, reduce="amax" if largest else "amin")  # [S]
    out = torch.where(torch.isinf(out), torch.zeros_like(out), out)
    return out[seq_ids]


def gap_metrics(old_logp: Tensor, rollout_logp: Tensor, m: Tensor, seq_ids: Tensor, num_seqs: int
                ) -> dict[str, Tensor]:
    """The train/rollout gap metrics mis.py logs (its ``add_ppl_metrics``), per token ``[N]`` (a
    sequence-level one repeated on the sequence's tokens): each side's log-perplexity and
    perplexity, the KL estimates ``kl`` (``rollout - train``) and ``k3_kl``, the log-perplexity gap
    and its ``|.|``, the perplexity ratio, and the chi-square divergences of the token ratios and
    of the sequence's ratio."""
    train_mean = _seq_mean(old_logp, m, seq_ids, num_seqs)  # [S]
    roll_mean = _seq_mean(rollout_logp, m, seq_ids, num_seqs)  # [S]
    log_ratio = old_logp - rollout_logp  # [N]
    log_ppl_diff = (roll_mean - train_mean)[seq_ids]  # [N]
    rho = torch.exp(log_ratio.clamp(-_SAFETY_BOUND, _SAFETY_BOUND))  # [N]
    seq_log_ratio = segment_sum(log_ratio * m, seq_ids, num_seqs).clamp(-_SAFETY_BOUND, _SAFETY_BOUND)  # [S]
    return {
        "training_log_ppl": -train_mean[seq_ids], "training_ppl": torch.exp(-train_mean)[seq_ids],
        "rollout_log_ppl": -roll_mean[seq_ids], "rollout_ppl": torch.exp(-roll_mean)[seq_ids],
        "kl": rollout_logp - old_logp, "k3_kl": torch.exp(log_ratio) - log_ratio - 1,
        "log_ppl_diff": log_ppl_diff, "log_ppl_abs_diff": log_ppl_diff.abs(), "ppl_ratio": torch.exp(log_ppl_diff),
        "chi2_token": (_seq_mean(rho * rho, m, seq_ids, num_seqs) - 1.0)[seq_ids],
        "chi2_seq": (torch.exp(2.0 * seq_log_ratio) - 1.0)[seq_ids],
    }


def mis_weights(cfg: MisConfig, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, seq_ids: Tensor,
                num_seqs: int) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
    """mis.py's ``compute_mis_weights`` on flat tensors: ``(weights [N] or None without use_tis,
    the mask of the tokens kept [N], per-token metrics [N] each under ``mis_<name>``)``. The
    weights are 0 off the loss mask and carry no gradient."""
    m = mask.to(old_logp.dtype)  # [N]
    diff = (old_logp - rollout_logp).detach()  # [N]
    metrics = gap_metrics(old_logp.detach(), rollout_logp.detach(), m, seq_ids, num_seqs)
    if not cfg.use_tis:
        return None, mask, {f"mis_{k}": v for k, v in metrics.items()}
    upper = cfg.tis_upper_bound
    lower = cfg.tis_lower_bound if cfg.tis_lower_bound is not None else 1.0 / upper
    rs_lower = cfg.rs_lower_bound if cfg.rs_lower_bound is not None else lower
    rs_upper = cfg.rs_upper_bound if cfg.rs_upper_bound is not None else upper

    def fraction(x: Tensor) -> Tensor:
        return x.to(m.dtype)

    log_ratio = _level_log_ratio(diff, m, seq_ids, num_seqs, cfg.tis_level)  # [N]
    w = torch.exp(log_ratio.clamp(-_SAFETY_BOUND, _SAFETY_BOUND))  # [N]
    metrics["tis_weight_before_bound"] = w
    keep = m.clone()  # [N]
    if cfg.tis_mode == "truncate":
        metrics["tis_truncate_fraction"] = fraction(w > upper)
        w = w.clamp(0, upper) * m
    elif cfg.tis_mode == "clip":
        metrics["tis_clip_fraction_low"] = fraction(w < lower)
        metrics["tis_clip_fraction_high"] = fraction(w > upper)
        w = w.clamp(lower, upper) * m
    elif cfg.tis_mode == "mask":
        metrics["tis_mask_fraction_low"] = fraction(w < lower)
        metrics["tis_mask_fraction_high"] = fraction(w > upper)
        keep = m * ((w >= lower) & (w <= upper)).to(m.dtype)
        w = w * m
    else:
        raise ValueError(f"--tis-mode {cfg.tis_mode!r}: expected truncate, clip or mask")
    metrics["tis_weight_after_bound"] = w
    if cfg.use_rs:
        rs_log_ratio = log_ratio if cfg.rs_level == cfg.tis_level else \
            _level_log_ratio(diff, m, seq_ids, num_seqs, cfg.rs_level)  # [N]
        rs_w = torch.exp(rs_log_ratio.clamp(-_SAFETY_BOUND, _SAFETY_BOUND))  # [N]
        metrics["rs_mask_fraction_low"] = fraction(rs_w < rs_lower)
        metrics["rs_mask_fraction_high"] = fraction(rs_w > rs_upper)
        keep = keep * ((rs_w >= rs_lower) & (rs_w <= rs_upper)).to(m.dtype)
        if cfg.rs_veto_threshold is not None:
            # a sequence with one token far less likely to the trainer than to the engine is dropped whole
            # (the threshold's log in float32, as mis.py takes it: a token on the bound is judged alike)
            log_veto = float(torch.log(torch.tensor(cfg.rs_veto_threshold, dtype=torch.float32)))
            bad = (diff < log_veto) & (m > 0)  # [N]
            vetoed = segment_sum(bad.to(m.dtype), seq_ids, num_seqs) > 0  # [S]
            metrics["rs_catastrophic_token_fraction"] = fraction(bad)
            metrics["rs_catastrophic_seq_fraction"] = fraction(vetoed[seq_ids])
            keep = keep * (~vetoed[seq_ids]).to(m.dtype)
    metrics["is_ratio_mean_after_tis_rs"] = w
    if cfg.tis_batch_normalize:
        if cfg.tis_level == "token":
            mean = (w * m).sum() / m.sum().clamp(min=1)
        elif cfg.tis_level == "sequence":
            mean = _seq_mean(w, m, seq_ids, num_seqs).sum() / num_seqs
        else:
            raise ValueError(f"--tis-batch-normalize with --tis-level {cfg.tis_level}: only token or sequence")
        if mean > 1e-8:
            w = w / mean
            metrics["batch_norm_factor"] = mean.expand_as(w)
        else:
            metrics["batch_norm_factor"] = torch.ones_like(w)
    metrics["is_ratio_mean_final"] = _seq_mean(w, m, seq_ids, num_seqs)[seq_ids]
    metrics["is_ratio_min_final"] = _seq_extreme(w, m, seq_ids, num_seqs, largest=False)
    metrics["is_ratio_max_final"] = _seq_extreme(w, m, seq_ids, num_seqs, largest=True)
    return w.detach(), keep.to(mask.dtype), {f"mis_{k}": v.detach() for k, v in metrics.items()}


def mis_is(pg: Tensor, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, seq_ids: Tensor, num_seqs: int,
           cfg: MisConfig) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """MIS as an :data:`~train_backend.losses.ImportanceFn`: ``pg`` times :func:`mis_weights`'
    weights (unchanged without ``use_tis``), the tokens it rejects left out of every numerator."""
    w, keep, metrics = mis_weights(cfg, old_logp, rollout_logp, mask, seq_ids, num_seqs)
    return (pg if w is None else pg * w), keep, metrics


def builtin_importance(s: TrainSettings) -> ImportanceFn | None:
    """The ``--tis-function`` correction of a run as :func:`~train_backend.losses.rl_loss` takes
    it; None for ``vanilla`` (rl_loss's own :func:`~train_backend.losses.truncated_is`) or when
    ``--custom-tis-function-path`` chooses the function."""
    if s.custom_tis_function_path or s.tis_function == "vanilla":
        return None
    if s.tis_function == "icepop":
        cap, low, apply = s.tis_cap, s.tis_clip_low, s.use_tis

        def icepop(pg: Tensor, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, seq_ids: Tensor,
                   num_seqs: int) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            return icepop_is(pg, old_logp, rollout_logp, mask, seq_ids, num_seqs, cap, low, apply)
        return icepop
    cfg = MisConfig.from_settings(s)

    def mis(pg: Tensor, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, seq_ids: Tensor,
            num_seqs: int) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        return mis_is(pg, old_logp, rollout_logp, mask, seq_ids, num_seqs, cfg)
    return mis
