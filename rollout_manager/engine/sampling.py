"""Batched sampling with per-row settings and per-row random generators.

Log-probs follow SGLang's default: ``log_softmax(logits / temperature)`` over the whole
vocabulary, before top-k/top-p/min-p filtering; greedy rows use temperature 1. The trainer
must compute its log-probs the same way.

Sampling draws one exponential variate per vocabulary entry per step and takes
``argmax(p / E)`` (equivalent to drawing from ``p``). A request with a ``sampling_seed`` owns a
``torch.Generator`` that only it advances, so its output does not depend on its batch mates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .protocol import SAMPLING_EPS, SamplingParams


@dataclass
class RowParams:
    """Per-row sampling tensors for the running batch (rebuilt when rows join or leave)."""

    temps: torch.Tensor  # [B, 1] temperature (1 for greedy rows)
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    top_k: torch.Tensor  # [B] long, vocab size where disabled
    top_p: torch.Tensor  # [B]
    min_p: torch.Tensor  # [B]
    need_filter: bool
    generators: list[torch.Generator | None]  # per-row generator (None: the shared one)
    seeded: list[int]  # rows with their own generator
    unseeded: torch.Tensor  # [n] long, rows sampled from the shared generator


def build_row_params(params: list[SamplingParams], generators: list[torch.Generator | None],
                     vocab_size: int, device: torch.device) -> RowParams:
    """Stack per-request SamplingParams into batched tensors."""
    greedy = [p.greedy for p in params]
    # temperature 0 means greedy with log-probs at temperature 1 (SGLang); top_k == 1 is greedy too
    # but keeps its temperature for the log-probs
    temps = torch.tensor([[1.0 if p.temperature < SAMPLING_EPS else p.temperature] for p in params],
                         dtype=torch.float32, device=device)  # [B, 1]
    top_k = torch.tensor([vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params],
                         dtype=torch.long, device=device)  # [B]
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)  # [B]
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)  # [B]
    need_filter = any(not g and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0) for p, g in zip(params, greedy))
    seeded = [i for i, g in enumerate(generators) if g is not None and not greedy[i]]
    unseeded = torch.tensor([i for i, g in enumerate(generators) if g is None and not greedy[i]],
                            dtype=torch.long, device=device)  # [n]
    return RowParams(temps, torch.tensor(greedy, device=device), all(greedy), top_k, top_p, min_p,
                     need_filter, generators, seeded, unseeded)


def _filtered_probs(probs: torch.Tensor, rows: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply top-k, top-p and min-p; return (sorted filtered probs [B, V], sort index [B, V])."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)  # [B, V]
    V = probs.shape[-1]
    rank = torch.arange(V, device=probs.device)  # [V]
    drop = rank[None, :] >= rows.top_k[:, None]  # [B, V]
    # top-p: drop a token when the mass before it already reaches top_p (the first is always kept)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # [B, V]
    drop |= before > rows.top_p[:, None]
    drop |= sorted_p < (rows.min_p * sorted_p[:, 0])[:, None]
    return sorted_p.masked_fill(drop, 0.0), idx


def sample(logits: torch.Tensor, rows: RowParams, shared: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (tokens [B] long, logprobs [B] float32)."""
    logits = logits.float()  # [B, V]
    logprobs = torch.log_softmax(logits / rows.temps, dim=-1)  # [B, V]
    tokens = logits.argmax(dim=-1)  # [B]
    if not rows.all_greedy:
        probs = logprobs.exp()  # [B, V]
        idx = None
        if rows.need_filter:
            probs, idx = _filtered_probs(probs, rows)
        noise = torch.empty_like(probs)  # [B, V]
        if len(rows.unseeded) == probs.shape[0]:  # the common case: one draw for the whole batch
            noise.exponential_(generator=shared)
        else:
            if rows.unseeded.numel():
                noise[rows.unseeded] = torch.empty((rows.unseeded.numel(), probs.shape[-1]), device=probs.device,
                                                   dtype=probs.dtype).exponential_(generator=shared)
            for i in rows.seeded:
                noise[i].exponential_(generator=rows.generators[i])
            # greedy rows get noise 1 (their draw is ignored below)
            noise[rows.greedy] = 1.0
        # E == 0 would make p / E undefined
        choice = (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)  # [B]
        if idx is not None:
            choice = idx.gather(1, choice[:, None]).squeeze(1)  # [B] back to vocabulary ids
        tokens = torch.where(rows.greedy, tokens, choice)  # [B]
    lp = logprobs.gather(1, tokens[:, None]).squeeze(1)  # [B]
    return tokens, lp
