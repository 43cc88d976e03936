"""From groups of Samples to packed micro-batches (shared by both backends).

1. :func:`prepare_batch` validates the samples, computes per-sample advantages per group and
   sets aside (and counts) what cannot be trained: non-trainable status, empty responses, all-zero
   loss masks, sequences longer than the model's context.
2. :func:`split_steps` cuts the trainable samples into optimizer steps (``--global-batch-size``),
   :func:`balance` gives each data-parallel rank a share with about equal tokens, and
   :func:`plan_micro_batches` bins a rank's share under ``--max-tokens-per-micro-batch``.
3. :func:`pack` concatenates a micro-batch's sequences into rows with restarting position ids
   (HF models detect the packing from the position ids and mask attention per sequence) and
   gathers the flat ``[N]`` per-response-token tensors that the losses use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from buffer.sample import TRAINABLE, Sample, check_sample
from train_backend.losses import (LossDenominators, compute_advantages, gae_advantages, opd_advantages,
                                  whiten_advantages)

if TYPE_CHECKING:
    from train_backend.hooks import LogProbsFn, TrainHooks

SKIP_REASONS = ("status", "empty_response", "zero_loss_mask", "too_long")


@dataclass
class RolloutBatch:
    """The trainable samples of one rollout batch and their advantages (same order)."""

    samples: list[Sample]
    advantages: list[float]
    num_input_samples: int
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    reward_mean: float = 0.0


def prepare_batch(groups: list[list[Sample]], estimator: str, reward_key: str | None,
                  max_seq_len: int | None, hooks: "TrainHooks | None" = None) -> RolloutBatch:
    """Validate ``groups``, compute advantages per group, keep what can be trained.

    Samples whose status is not completed/truncated are left out of the group baselines.
    Samples with an empty response, an all-zero loss mask, or more than ``max_seq_len`` tokens
    still count in their group's baseline (their reward is real) but are not trained on; each
    reason is counted in ``skipped``. Malformed samples raise ``ValueError``. ``hooks``: slime's
    ``--custom-reward-post-process-path`` / ``--custom-convert-samples-to-train-data-path`` replace
    the estimator's values (and the converter the samples' training fields).
    """
    if not isinstance(groups, list) or not groups:
        raise ValueError("train_step: expected a non-empty list of groups")
    width = max(len(g) for g in groups)
    rewards = torch.full((len(groups), width), float("nan"), dtype=torch.float64)  # [G, n]
    skipped = dict.fromkeys(SKIP_REASONS, 0)
    for gi, group in enumerate(groups):
        if not isinstance(group, list) or not group:
            raise ValueError(f"group {gi}: expected a non-empty list of Samples")
        for si, s in enumerate(group):
            check_sample(s, f"group {gi}, sample {si}")
            if s.prompt_length == 0:
                raise ValueError(f"group {gi}, sample {si}: field 'tokens' holds no prompt token before "
                                 "the response (the first response token cannot be scored)")
            if s.status in TRAINABLE:
                rewards[gi, si] = s.scalar_reward(reward_key)
            else:
                skipped["status"] += 1
    adv = compute_advantages(rewards, estimator)  # [G, n]
    where = [(gi, si) for gi, g in enumerate(groups) for si, s in enumerate(g) if s.status in TRAINABLE]
    custom = hooks.train_values([groups[gi][si] for gi, si in where]) if hooks is not None and where else None
    if custom is not None:
        groups = [list(g) for g in groups]  # the caller's groups stay as they were
        for (gi, si), s, value in zip(where, *custom):
            check_sample(s, f"group {gi}, sample {si} (as the train-data plugin returned it)")
            groups[gi][si] = s
            adv[gi, si] = value
    samples, advantages = [], []
    for gi, group in enumerate(groups):
        for si, s in enumerate(group):
            if s.status not in TRAINABLE:
                continue
            if s.response_length == 0:
                skipped["empty_response"] += 1
            elif not any(s.loss_mask):
                skipped["zero_loss_mask"] += 1
            elif max_seq_len is not None and len(s.tokens) > max_seq_len:
                skipped["too_long"] += 1
            else:
                samples.append(s)
                advantages.append(float(adv[gi, si]))
    valid = rewards[~torch.isnan(rewards)]
    reward_mean = float(valid.mean()) if valid.numel() else 0.0
    return RolloutBatch(samples, advantages, sum(len(g) for g in groups), skipped, reward_mean)


@dataclass
class TrainStepStart:
    """What a train step (:mod:`train_backend.step`) starts from: the prepared batch, the
    advantages (whitened with ``--normalize-advantages``), and the optimizer steps (sample index
    ranges) with the loss denominators of each; no steps when nothing is trainable."""

    batch: RolloutBatch
    advantages: list
    steps: list[range]
    denominators: list[LossDenominators]
    # --advantage-estimator ppo: the critic's values of each sample's response tokens before the
    # update, and GAE's returns (the value loss's targets)
    values: list[list[float]] | None = None
    returns: list[list[float]] | None = None
    # --use-opd: the sampled reverse KL to the teacher over the loss tokens (slime's opd_reverse_kl)
    opd_reverse_kl: float | None = None


def begin_train_step(groups: list[list[Sample]], settings: Any, step: int, max_seq_len: int | None,
                     hooks: "TrainHooks | None" = None, log_probs: "LogProbsFn | None" = None,
                     values: "Callable[[list[Sample]], list[list[float]]] | None" = None) -> TrainStepStart:
    """The head of a train step, before any micro-batch (``settings`` is a ``TrainSettings``).
    With ``hooks`` that read the rollout data (:attr:`TrainHooks.needs_rollout_data`), ``log_probs``
    gives them the policy's and the reference's log-probs (collective). With ``--advantage-estimator
    ppo``, ``values`` gives the critic's values of the samples' response tokens, and the advantages
    are GAE's, per token (before ``--normalize-advantages``, as in slime)."""
    batch = prepare_batch(groups, settings.advantage_estimator, settings.reward_key, max_seq_len, hooks)
    if not batch.samples:
        return TrainStepStart(batch, [], [], [])
    adv = batch.advantages
    old_values = returns = None
    if settings.advantage_estimator == "ppo":
        if values is None:
            raise ValueError("--advantage-estimator ppo needs a backend with a critic")
        old_values = values(batch.samples)
        adv, returns = gae_advantages(batch.samples, batch.advantages, old_values, settings.gamma, settings.lambd)
    opd_kl = None
    if settings.use_opd:  # after the estimator and before whitening, as slime's compute_advantages_and_returns
        assert log_probs is not None, "the backend must pass log_probs with --use-opd"
        adv, opd_kl = _apply_opd(batch.samples, adv, log_probs, settings)
    if settings.normalize_advantages:
        adv = whiten_advantages(batch.samples, adv)
    if hooks is not None and hooks.needs_rollout_data:  # before the denominators: it may change loss masks
        assert log_probs is not None, "the backend must pass log_probs with these hooks"
        adv = hooks.rollout_data_step(batch.samples, batch.advantages, adv, step, log_probs,
                                      settings.normalize_advantages)
    norm_length = float(settings.loss_agg_norm_length or max(x.response_length for x in batch.samples))
    steps = split_steps(len(batch.samples), batch.num_input_samples, settings.global_batch_size)
    denominators = [LossDenominators(float(sum(sum(batch.samples[i].loss_mask) for i in r)), float(len(r)),
                                     norm_length) for r in steps]
    return TrainStepStart(batch, adv, steps, denominators, old_values, returns, opd_kl)


def _apply_opd(samples: list[Sample], adv: list, log_probs: "LogProbsFn", settings: Any) -> tuple[list, float]:
    """``--use-opd``: the advantages with the teacher's reverse-KL term
    (:func:`~train_backend.losses.opd_advantages`; the student's log-probs: the policy's before this
    rollout's updates, one more no-grad pass, as slime's ``log_probs``), and the reverse KL over the
    loss tokens: each sample's mean, averaged over the samples (``--loss-agg token_mean``: over the
    tokens), as slime logs ``opd_reverse_kl``."""
    for s in samples:
        if s.teacher_log_probs is None or len(s.teacher_log_probs) != s.response_length:
            got = "none" if s.teacher_log_probs is None else f"{len(s.teacher_log_probs)}"
            raise ValueError(f"sample {s.index} (group {s.group_index}): --use-opd needs teacher_log_probs for each of "
                             f"its {s.response_length} response tokens, got {got} (is the teacher engine set: "
                             "--opd-teacher-url / --opd-teacher-load?)")
    student = log_probs("", samples)
    assert student is not None
    adv, kls = opd_advantages(adv, student, [s.teacher_log_probs for s in samples], settings.opd_kl_coef)
    masks = [torch.tensor(s.loss_mask, dtype=torch.float64) for s in samples]
    if settings.loss_agg == "token_mean":
        total = sum(float((k * m).sum()) for k, m in zip(kls, masks))
        return adv, total / max(sum(float(m.sum()) for m in masks), 1.0)
    return adv, sum(float((k * m).sum() / m.sum().clamp(min=1)) for k, m in zip(kls, masks)) / len(samples)


def split_steps(num_trainable: int, num_input_samples: int, global_batch_size: int | None) -> list[range]:
    """Index ranges of the optimizer steps of one rollout batch.

    The number of steps is ``ceil(num_input_samples / global_batch_size)`` (one step when unset),
    counted on the *input* so that skipped samples do not change the schedule; the trainable
    samples are spread over them as evenly as possible. Empty ranges are dropped.
    """
    steps = 1 if global_batch_size is None else max(1, math.ceil(num_input_samples / global_batch_size))
    steps = min(steps, max(num_trainable, 1))
    base, extra = divmod(num_trainable, steps)
    out, start = [], 0
    for i in range(steps):
        size = base + (1 if i < extra else 0)
        if size:
            out.append(range(start, start + size))
        start += size
    return out


def balance(lengths: list[int], parts: int) -> list[list[int]]:
    """Split item indices into ``parts`` lists of about equal total length (longest first,
    each to the currently lightest part). Every part is non-empty when ``len(lengths) >= parts``."""
    if parts <= 0:
        raise ValueError(f"parts={parts} must be > 0")
    loads = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        p = min(range(parts), key=lambda p: (loads[p], len(out[p])))
        out[p].append(i)
        loads[p] += lengths[i]
    return [sorted(o) for o in out]


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Bin item indices so each bin holds at most ``max_tokens`` tokens (first-fit decreasing).
    An item longer than ``max_tokens`` gets a bin of its own."""
    if max_tokens <= 0:
        raise ValueError(f"--max-tokens-per-micro-batch={max_tokens} must be > 0")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


@dataclass
class PackedMicroBatch:
    """Sequences packed into ``R`` rows, and the flat per-response-token tensors of the losses.

    Within a row, sequences are concatenated with position ids restarting at 0 (HF models mask
    attention per sequence from that); a row shorter than ``T`` is padded at its end, the padding
    continuing the last sequence's positions (no real token attends to it: attention is causal).
    """

    input_ids: Tensor  # [R, T]
    position_ids: Tensor  # [R, T]
    logit_index: Tensor  # [N] flat index (row * T + column) of the logits predicting each response token
    targets: Tensor  # [N] the response tokens
    seq_ids: Tensor  # [N] 0..S-1: which sequence (in the order given to pack) each token belongs to
    loss_mask: Tensor  # [N]
    advantages: Tensor  # [N] the sequence's advantage on each of its tokens
    rollout_logp: Tensor  # [N] engine log-probs (0 where missing)
    rollout_mask: Tensor  # [N] 1 where the engine reported a log-prob
    response_lengths: list[int]  # per sequence, to split [N] back into sequences
    num_tokens: int = 0  # real (non-padding) tokens in the rows
    # several rows: the columns whose logits some row needs [K], and each token's place among them [N]
    # (computed here, on the host: torch.unique on an accelerator would synchronize it)
    keep_columns: Tensor | None = None
    keep_inverse: Tensor | None = None
    total_lengths: list[int] = field(default_factory=list)  # per sequence: prompt + response tokens
    sequences: list[list[int]] = field(default_factory=list)  # per sequence: its tokens (slime's hooks)

    @property
    def num_seqs(self) -> int:
        return len(self.response_lengths)

    def to(self, device: torch.device | str) -> "PackedMicroBatch":
        moved = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        return PackedMicroBatch(**moved)

    def split(self, flat: Tensor) -> list[Tensor]:
        """Split a per-response-token tensor ``[N]`` into one tensor per sequence."""
        return list(torch.split(flat, self.response_lengths))


def pack(samples: list[Sample], advantages: list | None = None, row_len: int | None = None,
         pad_id: int = 0) -> PackedMicroBatch:
    """Pack ``samples`` (advantages per sample, or per response token as lists; default 0) into rows.

    ``row_len=None``: one row holding everything (for varlen attention kernels, which cost
    nothing for the packing). Otherwise rows of at most ``row_len`` tokens (first-fit decreasing;
    a longer sequence gets a row of its own): with a dense attention mask the cost grows with the
    square of the row length, so rows about as long as the longest sequence cost no more
    attention than padding and waste far fewer tokens.
    """
    if not samples:
        raise ValueError("pack: no samples")
    for s in samples:
        if not 0 < s.response_length < len(s.tokens):
            raise ValueError(f"sample {s.index}: response_length={s.response_length} cannot be scored "
                             f"(tokens: {len(s.tokens)}); need a non-empty response after a non-empty prompt")
    lengths = [len(s.tokens) for s in samples]
    rows = [list(range(len(samples)))] if row_len is None else plan_micro_batches(lengths, row_len)
    T = max(sum(lengths[j] for j in row) for row in rows)
    # built as Python lists and converted once: per-sample tensor ops dominate for short sequences
    ids: list[int] = []
    pos: list[int] = []
    start = [0] * len(samples)  # flat index of each sample's first token
    for r, row in enumerate(rows):
        for j in row:
            start[j] = len(ids)
            ids.extend(samples[j].tokens)
            pos.extend(range(lengths[j]))
        pad = (r + 1) * T - len(ids)
        ids.extend([pad_id] * pad)
        # padding continues the row's last sequence: causal attention keeps it invisible to the real
        # tokens, and a row holding one sequence then needs no packed mask at all (plain causal)
        last = lengths[row[-1]]
        pos.extend(range(last, last + pad))
    input_ids = torch.tensor(ids, dtype=torch.long).view(len(rows), T)  # [R, T]
    position_ids = torch.tensor(pos, dtype=torch.long).view(len(rows), T)  # [R, T]
    rl = [s.response_length for s in samples]
    logit_index = torch.tensor([i for j in range(len(samples))
                                for i in range(start[j] + lengths[j] - rl[j] - 1, start[j] + lengths[j] - 1)])  # [N]
    mask = [m for s in samples for m in s.loss_mask]
    rollout = [x for s, r in zip(samples, rl) for x in (s.rollout_log_probs or [0.0] * r)]
    have = [s.rollout_log_probs is not None for s in samples]
    counts = torch.tensor(rl)  # [S]
    keep_columns = keep_inverse = None
    if len(rows) > 1:
        keep_columns, keep_inverse = torch.unique(logit_index % T, return_inverse=True)  # [K], [N]
    return PackedMicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        logit_index=logit_index,
        targets=input_ids.view(-1)[logit_index + 1],  # [N]
        seq_ids=torch.repeat_interleave(torch.arange(len(samples)), counts),  # [N]
        loss_mask=torch.tensor(mask, dtype=torch.float32),  # [N]
        advantages=_token_advantages(advantages, counts),  # [N]
        rollout_logp=torch.tensor(rollout, dtype=torch.float32),  # [N]
        rollout_mask=torch.repeat_interleave(torch.tensor(have, dtype=torch.float32), counts),  # [N]
        response_lengths=rl,
        num_tokens=sum(lengths),
        keep_columns=keep_columns,
        keep_inverse=keep_inverse,
        total_lengths=lengths,
        sequences=[list(s.tokens) for s in samples],
    )


def _token_advantages(advantages: list | None, counts: Tensor) -> Tensor:
    """``[N]``: each sample's advantage on each of its response tokens (or its per-token list)."""
    if advantages and isinstance(advantages[0], list):
        return torch.tensor([a for adv in advantages for a in adv], dtype=torch.float32)
    values = [0.0] * len(counts) if advantages is None else advantages
    return torch.repeat_interleave(torch.tensor(values, dtype=torch.float32), counts)
