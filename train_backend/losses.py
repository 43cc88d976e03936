"""All RL math, as pure functions on tensors (shared by the torch and Megatron backends).

Layout: per-token tensors are *flat* over the response tokens of a packed micro-batch, ``[N]``,
with ``seq_ids [N]`` giving the sequence (0..S-1) each token belongs to. Sequence-level quantities
(GSPO's ratio, the seq-mean aggregations) reduce over ``seq_ids`` with ``index_add``; nothing
loops over tokens in Python.

Gradient accumulation: a step's loss is aggregated over the *whole optimizer step* (all its
micro-batches, on all data-parallel ranks), so every aggregation divides by step-wide
:class:`LossDenominators`; summing the per-micro-batch losses then gives exactly the loss of the
full batch, however it was split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from train_backend.interfaces import TrainSettings
from train_backend.interfaces import TrainSettings as _T  # the defaults of LossConfig

# exp() of a log-ratio above this overflows float32 to inf and inf * 0 = NaN; a ratio of e^20 is
# clipped by PPO anyway, so clamping changes no finite result that matters.
MAX_LOG_RATIO = 20.0


# --- log-probs --------------------------------------------------------------------------------
def log_probs_from_logits(logits: Tensor, targets: Tensor, temperature: float = 1.0,
                          with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-prob of ``targets`` under ``softmax(logits / temperature)``, as the engine computes them.

    ``logits [N, V]`` (any float dtype; computed in float32), ``targets [N]``. Returns
    ``(logp [N], entropy [N] or None)``; entropy is that of the same tempered distribution.
    """
    logits = logits.float() / temperature  # [N, V]
    lse = torch.logsumexp(logits, dim=-1)  # [N]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # [N]
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)  # [N, V]
        entropy = lse - (probs * logits).sum(-1)  # [N]
    return logp, entropy


# --- advantages -------------------------------------------------------------------------------
def _nan_mean(x: Tensor, dim: int | None = None) -> Tensor:
    if dim is None:
        return torch.nanmean(x)
    return torch.nanmean(x, dim=dim, keepdim=True)


def _nan_std(x: Tensor, dim: int | None = None) -> Tensor:
    """Unbiased (Bessel-corrected) std ignoring NaNs, like ``Tensor.std``; 0 where < 2 values."""
    valid = ~torch.isnan(x)
    count = valid.sum() if dim is None else valid.sum(dim=dim, keepdim=True)
    dev = torch.where(valid, x - _nan_mean(x, dim), torch.zeros_like(x))
    ss = (dev * dev).sum() if dim is None else (dev * dev).sum(dim=dim, keepdim=True)
    var = ss / (count - 1).clamp(min=1)
    return torch.where(count > 1, var.sqrt(), torch.zeros_like(var))


def compute_advantages(rewards: Tensor, estimator: str, eps: float = 1e-6) -> Tensor:
    """Per-sample advantages from per-sample rewards, one row per group.

    ``rewards [G, n]``: NaN marks a slot with no trainable sample (ragged or filtered groups);
    it is left out of every baseline and gets advantage 0. Returns ``[G, n]``.

    - ``grpo``, ``gspo``: ``(r - mean_g) / (std_g + eps)`` (unbiased std, as slime and TRL).
    - ``dr_grpo``: ``r - mean_g`` (Dr. GRPO drops the std).
    - ``rloo``: ``r - mean of the other samples of the group``.
    - ``reinforce_plus_plus``: ``(r - mean) / (std + eps)`` over the whole batch (REINFORCE++;
      a KL penalty goes through ``--use-kl-loss`` rather than into the reward).
    - ``reinforce_plus_plus_baseline``: ``r - mean_g``, then whitened over the whole batch.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, n], got shape {tuple(rewards.shape)}")
    r = rewards.double()  # [G, n]
    valid = ~torch.isnan(r)  # [G, n]
    if estimator in ("grpo", "gspo"):
        adv = (r - _nan_mean(r, 1)) / (_nan_std(r, 1) + eps)  # [G, n]
    elif estimator == "dr_grpo":
        adv = r - _nan_mean(r, 1)  # [G, n]
    elif estimator == "rloo":
        k = valid.sum(1, keepdim=True)  # [G, 1]
        total = torch.where(valid, r, torch.zeros_like(r)).sum(1, keepdim=True)  # [G, 1]
        baseline = (total - r) / (k - 1).clamp(min=1)  # [G, n]
        adv = torch.where(k > 1, r - baseline, torch.zeros_like(r))  # [G, n]
    elif estimator == "reinforce_plus_plus":
        adv = (r - _nan_mean(r)) / (_nan_std(r) + eps)  # [G, n]
    elif estimator == "reinforce_plus_plus_baseline":
        centred = r - _nan_mean(r, 1)  # [G, n]
        adv = (centred - _nan_mean(centred)) / (_nan_std(centred) + eps)  # [G, n]
    else:
        raise ValueError(f"--advantage-estimator={estimator!r} is not supported")
    return torch.where(valid, adv, torch.zeros_like(adv)).to(rewards.dtype)  # [G, n]


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(v - mean) / sqrt(var + eps)`` over the tokens where ``mask`` is 1 (slime's
    ``--normalize-advantages``; unbiased variance). ``values, mask [N]`` -> ``[N]``; masked-out
    tokens keep 0."""
    m = mask.to(values.dtype)  # [N]
    count = m.sum()
    if count < 2:
        return values * m
    mean = (values * m).sum() / count
    var = (((values - mean) ** 2) * m).sum() / (count - 1)
    return (values - mean) * torch.rsqrt(var + eps) * m  # [N]


# --- per-token losses -------------------------------------------------------------------------
def segment_sum(values: Tensor, seq_ids: Tensor, num_seqs: int) -> Tensor:
    """Sum ``values [N]`` per sequence: ``[S]``."""
    return torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add_(0, seq_ids, values)


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, seq_ids: Tensor, num_seqs: int) -> Tensor:
    """GSPO's sequence-level log importance ratio, ``mean_t(logp - old_logp)`` over each
    sequence's loss tokens, broadcast back to its tokens: ``[N]`` (differentiable in ``logp``)."""
    m = mask.to(logp.dtype)  # [N]
    num = segment_sum((logp - old_logp) * m, seq_ids, num_seqs)  # [S]
    den = segment_sum(m, seq_ids, num_seqs).clamp(min=1)  # [S]
    return (num / den)[seq_ids]  # [N]


def policy_loss(log_ratio: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float | None = None,
                eps_clip_c: float | None = None) -> tuple[Tensor, Tensor]:
    """PPO-clip surrogate per token, with clip-higher and dual clip.

    ``log_ratio [N]`` = ``logp - old_logp`` (token-level) or :func:`sequence_log_ratio` (GSPO);
    ``advantages [N]``. Returns ``(loss [N], clipped [N])``: ``loss = max(-r A, -clip(r, 1-eps,
    1+eps_high) A)``, and for ``A < 0`` with dual clip, ``min(that, -c A)``; ``clipped`` is 1.0 where
    the clipped branch was taken (PPO's clip fraction counts these).
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # [N]
    loss1 = -ratio * advantages  # [N]
    loss2 = -ratio.clamp(1.0 - eps_clip, 1.0 + high) * advantages  # [N]
    loss = torch.maximum(loss1, loss2)  # [N]
    clipped = (loss2 > loss1).to(loss.dtype)  # [N]
    if eps_clip_c is not None:
        loss3 = -eps_clip_c * advantages  # [N]
        loss = torch.where(advantages < 0, torch.minimum(loss, loss3), loss)  # [N]
    return loss, clipped


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's
    estimators): ``k1 = log r``, ``k2 = (log r)^2 / 2``, ``k3 = exp(-log r) - 1 + log r`` with
    ``log r = logp - ref_logp``. ``[N]`` -> ``[N]``."""
    log_r = logp - ref_logp  # [N]
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r * log_r
    if kind == "k3":
        neg = (-log_r).clamp(max=MAX_LOG_RATIO)  # [N]
        return torch.exp(neg) - 1.0 - neg
    raise ValueError(f"--kl-loss-type={kind!r}: expected k1, k2 or k3")


def tis_weights(old_logp: Tensor, rollout_logp: Tensor, cap: float) -> Tensor:
    """Truncated importance weight ``min(exp(old_logp - rollout_logp), cap)`` per token, no grad:
    corrects for the engine sampling from slightly different probabilities than the trainer's."""
    return torch.exp((old_logp - rollout_logp).clamp(max=MAX_LOG_RATIO)).clamp(max=cap).detach()  # [N]


# --- aggregation ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LossDenominators:
    """Step-wide normalizers: loss tokens, trainable sequences, and the constant length of
    ``seq_mean_token_sum_norm`` (Dr. GRPO's generation budget)."""

    num_tokens: float
    num_seqs: float
    norm_length: float

    @classmethod
    def of_batch(cls, mask: Tensor, seq_ids: Tensor, num_seqs: int, norm_length: float | None = None
                 ) -> "LossDenominators":
        """Denominators of one batch alone (no accumulation); ``norm_length`` defaults to the
        longest response."""
        if norm_length is None:
            norm_length = float(segment_sum(torch.ones_like(mask, dtype=torch.float32), seq_ids, num_seqs).max())
        return cls(float(mask.sum()), float(num_seqs), float(norm_length))


def aggregate(values: Tensor, mask: Tensor, mode: str, seq_ids: Tensor, num_seqs: int,
              denom: LossDenominators) -> Tensor:
    """Reduce per-token ``values [N]`` over the loss tokens (``mask [N]``) to a scalar.

    - ``token_mean``: sum over tokens / step's loss tokens (every token weighs the same).
    - ``seq_mean_token_mean``: each sequence's token mean, summed / step's sequences.
    - ``seq_mean_token_sum_norm``: token sums / (step's sequences x ``norm_length``) (Dr. GRPO).
    """
    m = mask.to(values.dtype)  # [N]
    if mode == "token_mean":
        return (values * m).sum() / max(denom.num_tokens, 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = segment_sum(values * m, seq_ids, num_seqs) / segment_sum(m, seq_ids, num_seqs).clamp(min=1)  # [S]
        return per_seq.sum() / max(denom.num_seqs, 1.0)
    if mode == "seq_mean_token_sum_norm":
        return (values * m).sum() / max(denom.num_seqs * denom.norm_length, 1.0)
    raise ValueError(f"--loss-agg={mode!r}: expected token_mean, seq_mean_token_mean or seq_mean_token_sum_norm")


# --- the whole objective ------------------------------------------------------------------------
@dataclass(frozen=True)
class LossConfig:
    """The loss-related part of :class:`~train_backend.interfaces.TrainSettings` (whose field
    defaults are the defaults here too: one place)."""

    sequence_level_ratio: bool = False  # GSPO (TrainSettings: advantage_estimator == "gspo")
    eps_clip: float = _T.eps_clip
    eps_clip_high: float | None = _T.eps_clip_high
    eps_clip_c: float | None = _T.eps_clip_c
    loss_agg: str = _T.loss_agg
    use_kl_loss: bool = _T.use_kl_loss
    kl_coef: float = _T.kl_coef
    kl_loss_type: str = _T.kl_loss_type
    entropy_coef: float = _T.entropy_coef
    use_tis: bool = _T.use_tis
    tis_cap: float = _T.tis_cap

    @classmethod
    def from_settings(cls, s: "TrainSettings") -> "LossConfig":
        return cls(s.advantage_estimator == "gspo", s.eps_clip, s.eps_clip_high, s.eps_clip_c, s.loss_agg,
                   s.use_kl_loss, s.kl_coef, s.kl_loss_type, s.entropy_coef, s.use_tis, s.tis_cap)


def rl_loss(cfg: LossConfig, denom: LossDenominators, logp: Tensor, old_logp: Tensor, advantages: Tensor,
            loss_mask: Tensor, seq_ids: Tensor, num_seqs: int, entropy: Tensor | None = None,
            ref_logp: Tensor | None = None, rollout_logp: Tensor | None = None,
            rollout_mask: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of one micro-batch, scaled so that summing it over the step's micro-batches gives
    the step's loss: ``agg(pg * tis) + kl_coef * agg(kl) - entropy_coef * agg(entropy)``.

    All per-token inputs are ``[N]``. ``rollout_logp`` (with ``rollout_mask`` = 1 where the engine
    reported a log-prob) feeds TIS and the train/rollout mismatch metric. Returns ``(loss, stats)``;
    every stat sums over micro-batches and data-parallel ranks: ``loss``/``pg_loss`` and the token
    metrics are already divided by the step's denominators, while ``train_rollout_logp_abs_diff``
    and ``train_rollout_kl`` are raw sums over ``_rollout_tokens`` tokens (the caller divides).
    """
    m = loss_mask.to(logp.dtype)  # [N]
    tok = max(denom.num_tokens, 1.0)
    if cfg.sequence_level_ratio:
        log_ratio = sequence_log_ratio(logp, old_logp, m, seq_ids, num_seqs)  # [N]
    else:
        log_ratio = logp - old_logp  # [N]
    pg, clipped = policy_loss(log_ratio, advantages, cfg.eps_clip, cfg.eps_clip_high, cfg.eps_clip_c)  # [N]
    stats: dict[str, Tensor] = {}
    has_rollout = rollout_logp is not None and rollout_mask is not None
    if cfg.use_tis:
        if not has_rollout or bool((rollout_mask[m > 0] == 0).any()):
            raise ValueError("--use-tis needs rollout_log_probs on every trained sample")
        w = tis_weights(old_logp, rollout_logp, cfg.tis_cap)  # [N]
        pg = pg * w  # [N]
        stats["tis_weight"] = (w * m).sum().detach() / tok
        stats["tis_clipfrac"] = ((w >= cfg.tis_cap).to(m.dtype) * m).sum() / tok
    pg_loss = aggregate(pg, m, cfg.loss_agg, seq_ids, num_seqs, denom)
    loss = pg_loss
    stats["pg_loss"] = pg_loss.detach()
    stats["pg_clipfrac"] = (clipped * m).sum().detach() / tok
    stats["ppo_kl"] = ((old_logp - logp).detach() * m).sum() / tok
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, cfg.kl_loss_type)  # [N]
        kl_loss = aggregate(kl, m, cfg.loss_agg, seq_ids, num_seqs, denom)
        if cfg.use_kl_loss and cfg.kl_coef != 0:
            loss = loss + cfg.kl_coef * kl_loss
        stats["kl"] = (kl.detach() * m).sum() / tok
    if entropy is not None:
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * aggregate(entropy, m, cfg.loss_agg, seq_ids, num_seqs, denom)
        stats["entropy"] = (entropy.detach() * m).sum() / tok
    if has_rollout:
        rm = m * rollout_mask.to(m.dtype)  # [N]
        diff = (old_logp - rollout_logp).detach()  # [N]
        stats["train_rollout_logp_abs_diff"] = (diff.abs() * rm).sum()
        stats["train_rollout_kl"] = (kl_penalty(rollout_logp, old_logp.detach(), "k3") * rm).sum()
        stats["_rollout_tokens"] = rm.sum()
    stats["loss"] = loss.detach()
    return loss, stats
