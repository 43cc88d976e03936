"""From groups of Samples to packed micro-batches (shared by both backends).

1. :func:`prepare_batch` validates the samples, computes per-sample advantages per group and
   sets aside (and counts) what cannot be trained: non-trainable status, empty responses, all-zero
   loss masks, sequences longer than the model's context.
2. :func:`split_steps` cuts the trainable samples into optimizer steps (``--global-batch-size``),
   :func:`balance` gives each data-parallel rank a share with about equal tokens, and
   :func:`plan_micro_batches` bins a rank's share under ``--max-tokens-per-micro-batch``.
3. :func:`pack` concatenates a micro-batch's sequences into one row with restarting position ids
   (no padding: HF models detect the packing from the position ids and mask attention per
   sequence) and gathers the flat ``[N]`` per-response-token tensors that the losses use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from buffer.sample import TRAINABLE, Sample, check_sample
from train_backend.losses import compute_advantages

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
                  max_seq_len: int | None) -> RolloutBatch:
    """Validate ``groups``, compute advantages per group, keep what can be trained.

    Samples whose status is not completed/truncated are left out of the group baselines.
    Samples with an empty response, an all-zero loss mask, or more than ``max_seq_len`` tokens
    still count in their group's baseline (their reward is real) but are not trained on; each
    reason is counted in ``skipped``. Malformed samples raise ``ValueError``.
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
    """One packed row of sequences and the flat per-response-token tensors of the losses."""

    input_ids: Tensor  # [1, T] all tokens of all sequences, concatenated
    position_ids: Tensor  # [1, T] restarting at 0 for each sequence
    logit_index: Tensor  # [N] position in the row whose logits predict each response token
    targets: Tensor  # [N] the response tokens
    seq_ids: Tensor  # [N] 0..S-1: which sequence each response token belongs to
    loss_mask: Tensor  # [N]
    advantages: Tensor  # [N] the sequence's advantage on each of its tokens
    rollout_logp: Tensor  # [N] engine log-probs (0 where missing)
    rollout_mask: Tensor  # [N] 1 where the engine reported a log-prob
    response_lengths: list[int]  # per sequence, to split [N] back into sequences

    @property
    def num_seqs(self) -> int:
        return len(self.response_lengths)

    def to(self, device: torch.device | str) -> "PackedMicroBatch":
        moved = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        return PackedMicroBatch(**moved)

    def split(self, flat: Tensor) -> list[Tensor]:
        """Split a per-response-token tensor ``[N]`` into one tensor per sequence."""
        return list(torch.split(flat, self.response_lengths))


def pack(samples: list[Sample], advantages: list[float] | None = None) -> PackedMicroBatch:
    """Pack ``samples`` into one row. ``advantages`` (per sample) default to 0."""
    if not samples:
        raise ValueError("pack: no samples")
    ids, pos, logit_index, seq_ids, rl = [], [], [], [], []
    rollout_logp, rollout_mask, mask, adv = [], [], [], []
    offset = 0
    for j, s in enumerate(samples):
        n, r = len(s.tokens), s.response_length
        if not 0 < r < n:
            raise ValueError(f"sample {s.index}: response_length={r} cannot be scored (tokens: {n}); "
                             "need a non-empty response after a non-empty prompt")
        ids.append(torch.as_tensor(s.tokens, dtype=torch.long))
        pos.append(torch.arange(n))
        logit_index.append(torch.arange(offset + n - r - 1, offset + n - 1))
        seq_ids.append(torch.full((r,), j, dtype=torch.long))
        rl.append(r)
        mask.append(torch.as_tensor(s.loss_mask, dtype=torch.float32))
        adv.append(torch.full((r,), 0.0 if advantages is None else advantages[j], dtype=torch.float32))
        have = s.rollout_log_probs is not None
        rollout_logp.append(torch.as_tensor(s.rollout_log_probs, dtype=torch.float32) if have else torch.zeros(r))
        rollout_mask.append(torch.full((r,), 1.0 if have else 0.0))
        offset += n
    input_ids = torch.cat(ids).unsqueeze(0)  # [1, T]
    return PackedMicroBatch(
        input_ids=input_ids,
        position_ids=torch.cat(pos).unsqueeze(0),  # [1, T]
        logit_index=torch.cat(logit_index),  # [N]
        targets=input_ids[0, torch.cat(logit_index) + 1],  # [N]
        seq_ids=torch.cat(seq_ids),  # [N]
        loss_mask=torch.cat(mask),  # [N]
        advantages=torch.cat(adv),  # [N]
        rollout_logp=torch.cat(rollout_logp),  # [N]
        rollout_mask=torch.cat(rollout_mask),  # [N]
        response_lengths=rl,
    )
