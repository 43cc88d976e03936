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

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from metric_keys import TRAIN_KL, TRAIN_PPO_KL, TRAIN_ROLLOUT_KL, TRAIN_ROLLOUT_LOGP_ABS_DIFF
from train_backend.settings import TrainSettings
from train_backend.settings import TrainSettings as _T  # the defaults of LossConfig

if TYPE_CHECKING:
    from buffer.sample import Sample

# The stats of rl_loss by how a step reduces them: means over the step (over its loss tokens, or
# its samples under seq_mean_token_mean), averaged over optimizer steps; and sums over the tokens
# (or, under seq_mean_token_mean, of the per-sample means) of the ROLLOUT_COUNT tokens (samples)
# that have the engine's log-probs, divided by their count over the rollout batch.
STEP_MEAN_STATS = ("loss", "pg_loss", "pg_clipfrac", TRAIN_PPO_KL.name, TRAIN_KL.name, "entropy", "tis_weight",
                   "tis", "tis_abs", "tis_clipfrac", "ois")
ROLLOUT_SUM_STATS = (TRAIN_ROLLOUT_LOGP_ABS_DIFF.name, TRAIN_ROLLOUT_KL.name)
ROLLOUT_COUNT = "_rollout_count"

# An importance-sampling correction of the per-token policy loss (--use-tis): (pg [N], old_logp
# [N], rollout_logp [N], mask [N], seq_ids [N], num_seqs) -> (pg [N] corrected, the mask of the
# tokens the numerators sum [N], per-token stats [N] each, reduced like the loss-token metrics).
ImportanceFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int], "tuple[Tensor, Tensor, dict[str, Tensor]]"]
# The policy-gradient loss of a micro-batch from (pg [N], the numerators' mask [N], seq_ids [N],
# num_seqs), already divided by the step's denominators (micro-batch losses sum to the step's).
ReducerFn = Callable[[Tensor, Tensor, Tensor, int], Tensor]


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

    - ``grpo``, ``gspo``, ``cispo``: ``(r - mean_g) / (std_g + eps)`` (unbiased std, as slime and TRL).
    - ``dr_grpo``: ``r - mean_g`` (Dr. GRPO drops the std).
    - ``rloo``: ``r - mean of the other samples of the group``.
    - ``reinforce_plus_plus``: ``r`` (REINFORCE++: slime's discounted return with ``gamma = 1``,
      which is ``r`` on every token up to the last loss token; a KL penalty goes through
      ``--use-kl-loss`` rather than into the reward).
    - ``reinforce_plus_plus_baseline``: ``r - mean_g``.
    - ``ppo``: ``r``, the sequence reward that :func:`gae_advantages` puts on the last response
      token before GAE turns it, with the critic's values, into per-token advantages.

    The two REINFORCE++ estimators are whitened afterwards, over the loss tokens of the rollout
    batch, by ``--normalize-advantages`` (:func:`masked_whiten`), as slime does; slime and
    :class:`~train_backend.interfaces.TrainSettings` require that flag with them. Whitening here,
    per sample, would weigh a 1-token and a 1000-token response alike.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, n], got shape {tuple(rewards.shape)}")
    r = rewards.double()  # [G, n]
    valid = ~torch.isnan(r)  # [G, n]
    if estimator in ("grpo", "gspo", "cispo"):
        adv = (r - _nan_mean(r, 1)) / (_nan_std(r, 1) + eps)  # [G, n]
    elif estimator == "dr_grpo":
        adv = r - _nan_mean(r, 1)  # [G, n]
    elif estimator == "rloo":
        k = valid.sum(1, keepdim=True)  # [G, 1]
        total = torch.where(valid, r, torch.zeros_like(r)).sum(1, keepdim=True)  # [G, 1]
        baseline = (total - r) / (k - 1).clamp(min=1)  # [G, n]
        adv = torch.where(k > 1, r - baseline, torch.zeros_like(r))  # [G, n]
    elif estimator in ("reinforce_plus_plus", "ppo"):
        adv = r  # [G, n]
    elif estimator == "reinforce_plus_plus_baseline":
        adv = r - _nan_mean(r, 1)  # [G, n]
    else:
        raise ValueError(f"--advantage-estimator={estimator!r} is not supported")
    return torch.where(valid, adv, torch.zeros_like(adv)).to(rewards.dtype)  # [G, n]


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(v - mean) / sqrt(var + eps)`` over the tokens where ``mask`` is 1 (slime's
    ``--normalize-advantages``, ``distributed_masked_whiten``: unbiased variance, none with one
    token). ``values, mask [N]`` -> ``[N]``; masked-out tokens are 0 (slime whitens them too, and
    its loss then masks them out); with no token under the mask (slime raises) all are 0."""
    m = mask.to(values.dtype)  # [N]
    count = m.sum()
    if count == 0:
        return values * m
    mean = (values * m).sum() / count
    var = (((values - mean) ** 2) * m).sum() / (count - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps) * m  # [N]


def whiten_advantages(samples: "list[Sample]", advantages: list) -> list:
    """``--normalize-advantages``: whiten the advantages over all loss tokens (a sample weighs as
    much as its loss tokens, as slime whitens token-level advantages). Per-sample floats stay
    per-sample; per-token lists (a custom advantage function's) are whitened token by token."""
    if advantages and isinstance(advantages[0], list):
        flat = torch.tensor([a for adv in advantages for a in adv], dtype=torch.float64)  # [T]
        mask = torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.float64)  # [T]
        white = masked_whiten(flat, mask)  # [T]
        return [t.tolist() for t in torch.split(white, [s.response_length for s in samples])]
    counts = torch.tensor([sum(s.loss_mask) for s in samples])  # [B]
    per_token = torch.tensor(advantages, dtype=torch.float64).repeat_interleave(counts)  # [sum(counts)]
    white = masked_whiten(per_token, torch.ones_like(per_token))  # [sum(counts)]
    return white[torch.cumsum(counts, 0) - counts].tolist()  # each sample's first token


# --- on-policy distillation ------------------------------------------------------------------------
def opd_advantages(advantages: list, student: list[list[float]], teacher: list[list[float]], kl_coef: float
                   ) -> tuple[list[list[float]], list[Tensor]]:
    """``--use-opd``: each sample's advantages minus ``kl_coef`` times the sampled reverse KL to the
    teacher, per response token: ``A_t - kl_coef * (log pi_student(a_t) - log pi_teacher(a_t))``
    (slime's ``apply_opd_kl_to_advantages``, slime/backends/megatron_utils/loss.py; Thinking Machines'
    on-policy distillation). ``advantages``: one float per sample (broadcast to its tokens) or one
    list per sample; ``student``, ``teacher``: per sample, the log-probs of its response tokens (the
    trainer's before this rollout's updates, and the teacher engine's). Returns the per-token
    advantages and each sample's reverse KL ``[R]`` (float64), applied before
    ``--normalize-advantages`` as in slime."""
    out, kls = [], []
    for adv, s, t in zip(advantages, student, teacher, strict=True):
        kl = torch.tensor(s, dtype=torch.float64) - torch.tensor(t, dtype=torch.float64)  # [R]
        base = torch.tensor(adv, dtype=torch.float64) if isinstance(adv, list) else torch.full_like(kl, float(adv))
        out.append((base - kl_coef * kl).tolist())
        kls.append(kl)
    return out, kls


# --- PPO with a critic: token-level rewards, GAE, the clipped value loss -------------------------
def token_level_rewards(rewards: Tensor, response_lengths: list[int], kl: Tensor | None = None,
                        kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards of PPO, flat ``[N]`` over the sequences' response tokens: ``-kl_coef * kl``
    on every token (slime's ``--kl-coef`` penalty; 0 without ``kl``), plus each sequence's reward
    ``rewards [S]`` on its last response token (slime's ``ppo`` branch of
    ``compute_advantages_and_returns``: the last response token, not the last loss token)."""
    lengths = torch.as_tensor(response_lengths, device=rewards.device)  # [S]
    if kl is None:
        out = torch.zeros(int(lengths.sum()), dtype=rewards.dtype, device=rewards.device)  # [N]
    else:
        out = -kl_coef * kl.to(rewards.dtype)  # [N]
    return out.index_add(0, torch.cumsum(lengths, 0) - 1, rewards)  # [N]


def gae(token_rewards: Tensor, values: Tensor, response_lengths: list[int], gamma: float,
        lambd: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2015) per sequence: ``delta_t = r_t + gamma
    V_{t+1} - V_t`` with ``V`` after the last response token 0, ``A_t = delta_t + gamma lambd
    A_{t+1}``, returns ``A_t + V_t``. ``token_rewards, values [N]`` flat over the sequences'
    response tokens (``response_lengths``); returns ``(advantages [N], returns [N])``, no grad.
    Every response token counts, masked or not, as in slime. The recursion runs backwards over
    the positions of the sequences padded to the longest, all sequences at once."""
    with torch.no_grad():
        r = torch.nn.utils.rnn.pad_sequence(list(torch.split(token_rewards, response_lengths)), batch_first=True)
        v = torch.nn.utils.rnn.pad_sequence(list(torch.split(values.to(r.dtype), response_lengths)),
                                            batch_first=True)  # [S, T], 0 past each sequence's end
        adv = torch.zeros_like(r)  # [S, T]
        last = torch.zeros_like(r[:, 0])  # [S]
        for t in reversed(range(r.shape[1])):
            next_v = v[:, t + 1] if t + 1 < r.shape[1] else torch.zeros_like(last)  # [S]
            last = r[:, t] + gamma * next_v - v[:, t] + gamma * lambd * last
            adv[:, t] = last
        valid = torch.arange(r.shape[1], device=r.device) < torch.as_tensor(response_lengths, device=r.device)[:, None]
        return adv[valid], (adv + v)[valid]  # [N] each, in the sequences' order


def gae_advantages(samples: "list[Sample]", rewards: list[float], values: list[list[float]], gamma: float,
                   lambd: float) -> tuple[list[list[float]], list[list[float]]]:
    """``--advantage-estimator ppo``: each sample's per-token advantages and returns from its
    reward (on its last response token, :func:`token_level_rewards`) and the critic's ``values``
    of its response tokens (:func:`gae`), in float64."""
    lengths = [s.response_length for s in samples]
    for s, v in zip(samples, values):
        if len(v) != s.response_length:
            raise ValueError(f"sample {s.index}: {len(v)} critic values for {s.response_length} response tokens")
    r = token_level_rewards(torch.tensor(rewards, dtype=torch.float64), lengths)  # [N]
    adv, ret = gae(r, torch.tensor([x for v in values for x in v], dtype=torch.float64), lengths, gamma, lambd)
    return [a.tolist() for a in torch.split(adv, lengths)], [x.tolist() for x in torch.split(ret, lengths)]


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss per token: ``max((V_clip - R)^2, (V - R)^2)`` with ``V_clip = V_old +
    clamp(V - V_old, -value_clip, value_clip)`` (slime's ``value_loss_function``; OpenRLHF's and
    TRL's ``ValueLoss`` halve it). ``[N]`` each; returns ``(loss [N], clipped [N])``, ``clipped``
    1.0 where ``|V - V_old| > value_clip`` (slime's ``value_clipfrac``)."""
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)  # [N]
    loss = torch.maximum((clipped_values - returns) ** 2, (values - returns) ** 2)  # [N]
    return loss, ((values - old_values).abs() > value_clip).to(values.dtype)


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
    # No clamp on the log-ratio (slime and TRL have none): for A < 0 without dual clip the
    # unclipped branch ``r |A|`` is the loss however large r is, and a clamp would zero its gradient.
    ratio = torch.exp(log_ratio)  # [N]
    loss1 = -ratio * advantages  # [N]
    loss2 = -ratio.clamp(1.0 - eps_clip, 1.0 + high) * advantages  # [N]
    loss = torch.maximum(loss1, loss2)  # [N]
    clipped = (loss2 > loss1).to(loss.dtype)  # [N]
    if eps_clip_c is not None:
        loss3 = -eps_clip_c * advantages  # [N]
        loss = torch.where(advantages < 0, torch.minimum(loss, loss3), loss)  # [N]
    return loss, clipped


def cispo_loss(log_ratio: Tensor, logp: Tensor, advantages: Tensor, eps_clip: float,
               eps_clip_high: float | None = None) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eqs. 4-5) per token: ``-sg(clip(r, 1 - eps, 1 + eps_high))
    * A * logp`` with ``r = exp(log_ratio)``. The clipped ratio carries no gradient, so a clipped
    token still gets ``-w A`` through its log-prob (PPO's clip zeroes it). ``eps_clip >= 1`` turns the
    lower bound off (the paper's one-sided clip). Returns ``(loss [N], clipped [N])``, ``clipped``
    1.0 where the ratio was clipped."""
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(log_ratio)  # [N]
    w = ratio.clamp(1.0 - eps_clip, 1.0 + high)  # [N]
    return -w.detach() * advantages * logp, (w != ratio).to(logp.dtype)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's
    estimators): ``k1 = log r``, ``k2 = (log r)^2 / 2``, ``k3 = exp(-log r) - 1 + log r`` with
    ``log r = logp - ref_logp``. ``[N]`` -> ``[N]``. Unclamped, as slime's ``compute_approx_kl``
    and TRL's k3 term; ``low_var_kl`` is slime's name for k3 clamped to [-10, 10] (its only clamp)."""
    log_r = logp - ref_logp  # [N]
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r * log_r
    if kind in ("k3", "low_var_kl"):
        neg = -log_r  # [N]
        k3 = torch.exp(neg) - 1.0 - neg
        return k3.clamp(-10.0, 10.0) if kind == "low_var_kl" else k3
    raise ValueError(f"--kl-loss-type={kind!r}: expected k1, k2, k3 or low_var_kl")


def truncated_is(pg: Tensor, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, seq_ids: Tensor, num_seqs: int,
                 cap: float, low: float = 0.0) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The built-in :data:`ImportanceFn` (``cap``, ``low`` bound): ``pg`` times the truncated
    importance weight ``clamp(exp(old_logp - rollout_logp), low, cap)`` per token, no grad (it
    corrects for the engine sampling from slightly different probabilities than the trainer's),
    every loss token kept. Stats: ``tis_weight`` (the weight applied), and slime's ``tis`` (the raw
    ratio), ``tis_abs`` (``|ratio - 1|``) and ``tis_clipfrac`` (the tokens whose weight was clipped)."""
    ratio = torch.exp(old_logp - rollout_logp).detach()  # [N]
    w = ratio.clamp(min=low, max=cap)  # [N]; an overflow to inf caps too
    return pg * w, mask, {"tis_weight": w, "tis": ratio, "tis_abs": (ratio - 1).abs(),
                          "tis_clipfrac": (w != ratio).to(mask.dtype)}


# --- aggregation ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LossDenominators:
    """Step-wide normalizers: loss tokens, sequences, and the constant length of
    ``seq_mean_token_sum_norm`` (Dr. GRPO's generation budget).

    ``num_seqs`` counts every sample of the step, also one with an empty response or an all-zero
    loss mask (see :func:`count_samples_without_loss_tokens`): slime divides the seq-mean losses by
    the step's samples and TRL by its batch size, a constant that such a sample adds 0 to the
    numerator of but still counts in."""

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


def count_samples_without_loss_tokens(denominators: list[LossDenominators], count: int) -> list[LossDenominators]:
    """Add ``count`` samples that have no loss token (empty response, all-zero loss mask) to the
    sequence counts of the optimizer steps ``denominators``, spread over the steps as evenly as
    the trained samples are (``batching.split_steps``; which step each would have been in is not
    kept). The batch preparation sets such samples aside, since they add nothing to the loss or
    its gradient, but slime and TRL count them in the seq-mean denominators; without them the
    seq-mean losses and gradients come out ``samples / trained samples`` times theirs."""
    if count < 0:
        raise ValueError(f"count={count} must be >= 0")
    if not denominators:
        return []
    base, extra = divmod(count, len(denominators))
    return [replace(d, num_seqs=d.num_seqs + base + (1 if k < extra else 0)) for k, d in enumerate(denominators)]


def aggregate(values: Tensor, mask: Tensor, mode: str, seq_ids: Tensor, num_seqs: int,
              denom: LossDenominators, num_mask: Tensor | None = None) -> Tensor:
    """Reduce per-token ``values [N]`` over the loss tokens (``mask [N]``) to a scalar.

    - ``token_mean``: sum over tokens / step's loss tokens (every token weighs the same).
    - ``seq_mean_token_mean``: each sequence's token mean, summed / step's sequences (slime's
      default, TRL's ``grpo``; a sequence with no loss token adds 0 and still counts).
    - ``seq_mean_token_sum_norm``: token sums / (step's sequences x ``norm_length``) (Dr. GRPO).

    ``num_mask``: the tokens summed in the numerators when they differ from ``mask`` (a custom TIS
    function's rejections); the per-sequence counts stay ``mask``'s, as in slime.
    """
    m = mask.to(values.dtype)  # [N]
    nm = m if num_mask is None else num_mask.to(values.dtype)  # [N]
    if mode == "token_mean":
        return (values * nm).sum() / max(denom.num_tokens, 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = segment_sum(values * nm, seq_ids, num_seqs) / segment_sum(m, seq_ids, num_seqs).clamp(min=1)  # [S]
        return per_seq.sum() / max(denom.num_seqs, 1.0)
    if mode == "seq_mean_token_sum_norm":
        return (values * nm).sum() / max(denom.num_seqs * denom.norm_length, 1.0)
    raise ValueError(f"--loss-agg={mode!r}: expected token_mean, seq_mean_token_mean or seq_mean_token_sum_norm")


def sft_loss(logp: Tensor, loss_mask: Tensor, seq_ids: Tensor, num_seqs: int, denom: LossDenominators,
             loss_agg: str) -> tuple[Tensor, dict[str, Tensor]]:
    """``--loss-type sft_loss`` (slime's ``sft_loss_function``): the negative log-likelihood of the
    loss-mask tokens, ``-agg(logp)``, aggregated as the policy loss is (``--loss-agg``: slime's
    ``sum_of_sample_mean`` is ``seq_mean_token_mean``, its ``--calculate-per-token-loss`` is
    ``token_mean``) over the step's denominators. ``logp, loss_mask, seq_ids [N]``. Returns
    ``(loss, {"loss": loss})``, the one metric slime reports."""
    loss = -aggregate(logp, loss_mask, loss_agg, seq_ids, num_seqs, denom)
    return loss, {"loss": loss.detach()}


# --- the whole objective ------------------------------------------------------------------------
@dataclass(frozen=True)
class LossConfig:
    """The loss-related part of :class:`~train_backend.interfaces.TrainSettings` (whose field
    defaults are the defaults here too: one place)."""

    sequence_level_ratio: bool = False  # GSPO (TrainSettings: advantage_estimator == "gspo")
    cispo: bool = False  # CISPO's loss (TrainSettings: advantage_estimator == "cispo")
    eps_clip: float = _T.eps_clip
    eps_clip_high: float | None = _T.eps_clip_high
    eps_clip_c: float | None = _T.eps_clip_c
    loss_agg: str = _T.loss_agg
    use_kl_loss: bool = _T.use_kl_loss
    kl_coef: float = _T.kl_coef
    kl_loss_type: str = _T.kl_loss_type
    entropy_coef: float = _T.entropy_coef
    use_tis: bool = False  # TrainSettings' None (decided by the mode when built from flags) is off in code
    tis_cap: float = _T.tis_cap
    tis_clip_low: float = _T.tis_clip_low
    get_mismatch_metrics: bool = _T.get_mismatch_metrics

    @classmethod
    def from_settings(cls, s: "TrainSettings") -> "LossConfig":
        return cls(s.advantage_estimator == "gspo", s.advantage_estimator == "cispo", s.eps_clip, s.eps_clip_high, s.eps_clip_c, s.loss_agg,
                   s.use_kl_loss, s.kl_coef, s.kl_loss_type, s.entropy_coef, s.use_tis, s.tis_cap, s.tis_clip_low,
                   s.get_mismatch_metrics)


def rl_loss(cfg: LossConfig, denom: LossDenominators, logp: Tensor, old_logp: Tensor, advantages: Tensor,
            loss_mask: Tensor, seq_ids: Tensor, num_seqs: int, entropy: Tensor | None = None,
            ref_logp: Tensor | None = None, rollout_logp: Tensor | None = None,
            rollout_mask: Tensor | None = None, importance: ImportanceFn | None = None,
            reducer: ReducerFn | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of one micro-batch, scaled so that summing it over the step's micro-batches gives
    the step's loss: ``agg(pg * tis) + kl_coef * agg(kl) - entropy_coef * agg(entropy)``.

    All per-token inputs are ``[N]``. ``rollout_logp`` (with ``rollout_mask`` = 1 where the engine
    reported a log-prob) feeds TIS and the train/rollout mismatch metric. Returns ``(loss, stats)``;
    every stat sums over micro-batches and data-parallel ranks: ``loss``/``pg_loss`` and the
    per-token metrics (``pg_clipfrac``, ``ppo_kl``, ``kl``, ``entropy``, ``tis_weight``, ``tis``,
    ``tis_abs``, ``tis_clipfrac``) are already divided by the step's denominators, while
    ``train_rollout_logp_abs_diff`` and ``train_rollout_kl`` are sums over the ``ROLLOUT_COUNT``
    tokens, or per-sample means under ``seq_mean_token_mean``, that have ``rollout_logp`` (the caller
    divides). The per-token metrics are means over the step's loss tokens,
    except under ``seq_mean_token_mean``: there they are means over its samples of each sample's
    token mean, as slime reports them (its ``sum_of_sample_mean`` unless per-token loss).

    ``importance``: the TIS correction under ``--use-tis`` (default :func:`truncated_is` with
    ``--tis-clip``; ``--tis-function``'s others: :mod:`train_backend.mismatch`); ``reducer``: the policy-gradient loss's reduction (default :func:`aggregate`
    with ``--loss-agg``). slime's ``--custom-tis-function-path`` and
    ``--custom-pg-loss-reducer-function-path`` come in as these (:mod:`train_backend.hooks`). A
    correction that rejects tokens (zeros in the mask it returns) leaves them out of the numerators
    of every loss term and metric except its own metrics, over unchanged denominators, as slime does.
    """
    m = loss_mask.to(logp.dtype)  # [N]
    metric_agg = "seq_mean_token_mean" if cfg.loss_agg == "seq_mean_token_mean" else "token_mean"

    if cfg.sequence_level_ratio:
        log_ratio = sequence_log_ratio(logp, old_logp, m, seq_ids, num_seqs)  # [N]
    else:
        log_ratio = logp - old_logp  # [N]
    if cfg.cispo:
        pg, clipped = cispo_loss(log_ratio, logp, advantages, cfg.eps_clip, cfg.eps_clip_high)  # [N]
    else:
        pg, clipped = policy_loss(log_ratio, advantages, cfg.eps_clip, cfg.eps_clip_high, cfg.eps_clip_c)  # [N]
    stats: dict[str, Tensor] = {}
    has_rollout = rollout_logp is not None and rollout_mask is not None
    pg_mask = m  # the numerators' tokens: a custom TIS function may reject some
    if cfg.use_tis or cfg.get_mismatch_metrics:
        if not has_rollout or bool((rollout_mask[m > 0] == 0).any()):
            flag = "--use-tis (on by default in async mode; --no-use-tis trains without it)" if cfg.use_tis \
                else "--get-mismatch-metrics"
            raise ValueError(f"{flag} needs rollout_log_probs on every trained sample")
        if importance is None:
            weighted, pg_mask, tis_stats = truncated_is(pg, old_logp, rollout_logp, m, seq_ids, num_seqs,
                                                        cfg.tis_cap, cfg.tis_clip_low)
            if cfg.use_tis:
                pg = weighted
            else:  # --get-mismatch-metrics alone: the metrics, not the weights (none is applied)
                del tis_stats["tis_weight"]
        else:  # a custom function's result applies with either flag (slime's policy_loss_function)
            pg, pg_mask, tis_stats = importance(pg, old_logp, rollout_logp, m, seq_ids, num_seqs)
        # the correction's own metrics over every loss token (slime: the pre-rejection reducer), so
        # a rejected fraction is not driven to 0 by leaving the rejected tokens out
        stats.update({k: aggregate(v.detach(), m, metric_agg, seq_ids, num_seqs, denom) for k, v in tis_stats.items()})
        stats["ois"] = aggregate(torch.exp(log_ratio).detach(), m, metric_agg, seq_ids, num_seqs, denom)  # slime's

    # Everything else sums only the tokens the correction kept (slime rebuilds its reducer with the
    # returned masks: the loss terms, their metrics and the mismatch metric), over the original
    # denominators
    def agg(values: Tensor, mode: str = cfg.loss_agg) -> Tensor:
        return aggregate(values, m, mode, seq_ids, num_seqs, denom, num_mask=pg_mask)

    def metric(values: Tensor) -> Tensor:
        return agg(values.detach(), metric_agg)

    pg_loss = reducer(pg, pg_mask, seq_ids, num_seqs) if reducer is not None else agg(pg)
    loss = pg_loss
    stats["pg_loss"] = pg_loss.detach()
    stats["pg_clipfrac"] = metric(clipped)
    stats[TRAIN_PPO_KL.name] = metric(old_logp - logp)  # the plotted keys: metric_keys
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, cfg.kl_loss_type)  # [N]
        kl_loss = agg(kl)
        if cfg.use_kl_loss and cfg.kl_coef != 0:
            loss = loss + cfg.kl_coef * kl_loss
        stats[TRAIN_KL.name] = metric(kl)
    if entropy is not None:
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * agg(entropy)
        stats["entropy"] = metric(entropy)
    if has_rollout:
        rm = rollout_mask.to(m.dtype)  # [N]
        diff = (old_logp - rollout_logp).detach()  # [N]
        gaps = {TRAIN_ROLLOUT_LOGP_ABS_DIFF.name: diff.abs(),
                TRAIN_ROLLOUT_KL.name: kl_penalty(rollout_logp, old_logp.detach(), "k3")}
        if metric_agg == "seq_mean_token_mean":  # slime's per-sample means, over the samples that have them
            count = segment_sum(m, seq_ids, num_seqs).clamp(min=1)  # [S]
            has = segment_sum(m * rm, seq_ids, num_seqs) > 0  # [S]
            for name, g in gaps.items():
                stats[name] = (segment_sum(g * pg_mask * rm, seq_ids, num_seqs) / count)[has].sum()
            stats[ROLLOUT_COUNT] = has.to(m.dtype).sum()
        else:
            stats.update({name: (g * pg_mask * rm).sum() for name, g in gaps.items()})
            stats[ROLLOUT_COUNT] = (m * rm).sum()
    stats["loss"] = loss.detach()
    return loss, stats

