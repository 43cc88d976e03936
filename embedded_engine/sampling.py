"""Batched sampling with per-row settings and per-row random generators.

Log-probs follow SGLang's default: ``log_softmax(logits / temperature)`` over the whole
vocabulary, before top-k/top-p/min-p filtering; greedy rows use temperature 1. The trainer
must compute its log-probs the same way.

Sampling is by inverse CDF: one uniform variate per row and step, located in the row's
cumulative sum of probabilities in two levels (float64 sums of blocks of the vocabulary, then a
cumulative sum inside the one block it falls in). That reads the ``[B, V]`` probabilities once
more after the exp and draws B random numbers, where an exponential race (``argmax(p / E)``)
or ``torch.multinomial`` draws V per row, several times slower on the CPU at a large vocabulary.
The log-prob of the chosen token is ``z[tok] - logsumexp(z)`` with the
``logsumexp`` from the same pass, so no ``[B, V]`` log-softmax is materialised. A request with a
``sampling_seed`` owns a ``torch.Generator`` that only it advances (one draw per step), so its
output does not depend on its batch mates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .protocol import SAMPLING_EPS, SamplingParams


@dataclass
class RowParams:
    """Per-row sampling tensors for the running batch (rebuilt when rows join or leave)."""

    temps: torch.Tensor  # [B, 1] temperature (1 for greedy rows)
    unit_temps: bool  # every row's temperature is 1 (no division)
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
    return RowParams(temps, bool((temps == 1.0).all()), torch.tensor(greedy, device=device), all(greedy), top_k,
                     top_p, min_p,
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


def _uniforms(rows: RowParams, B: int, shared: torch.Generator, device: torch.device) -> torch.Tensor:
    """One U[0, 1) float64 per row: the shared generator for unseeded rows, a row's own for seeded
    rows (greedy rows get 0, unused)."""
    if len(rows.unseeded) == B:  # the common case: one draw for the whole batch
        return torch.rand(B, generator=shared, dtype=torch.float64, device=device)  # [B]
    u = torch.zeros(B, dtype=torch.float64, device=device)  # [B]
    if rows.unseeded.numel():
        u[rows.unseeded] = torch.rand(rows.unseeded.numel(), generator=shared, dtype=torch.float64, device=device)
    for i in rows.seeded:
        u[i] = torch.rand(1, generator=rows.generators[i], dtype=torch.float64, device=device)[0]
    return u


_BLOCK = 1024  # vocabulary entries per block of the two-level inverse CDF


def _first_above(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative mass exceeds ``target`` ``[B, 1]``: index i with
    probability ``w_i / mass`` for a uniform target in [0, mass), never a zero-weight entry. A
    target rounding up to the mass would run past the end: the index is capped at the first
    entry that reaches the row's full mass (a nonzero entry). Returns ``[B, 1]`` long."""
    mass = cdf[:, -1:].contiguous()  # [B, 1]
    choice = torch.searchsorted(cdf, target.contiguous(), right=True)  # [B, 1]
    return torch.minimum(choice, torch.searchsorted(cdf, mass, right=False))  # [B, 1]


def _draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index ``i`` of each row with probability ``weights[i] / weights.sum()`` (``weights [B, V]``
    nonnegative, each row with some mass; ``u [B]`` float64 uniforms in [0, 1)). Returns ``[B]``."""
    B, V = weights.shape
    if V <= _BLOCK:  # a small vocabulary: one level
        cdf = weights.cumsum(1, dtype=torch.float64)  # [B, V]
        return _first_above(cdf, u[:, None] * cdf[:, -1:]).squeeze(1)  # [B]
    nb, tail = divmod(V, _BLOCK)
    sums = [weights[:, :nb * _BLOCK].reshape(B, nb, _BLOCK).sum(-1, dtype=torch.float64)] if nb else []  # [B, nb]
    if tail:
        sums.append(weights[:, nb * _BLOCK:].sum(-1, keepdim=True, dtype=torch.float64))  # [B, 1]
    block_cdf = torch.cat(sums, 1).cumsum(1) if len(sums) > 1 else sums[0].cumsum(1)  # [B, nblocks]
    target = u[:, None] * block_cdf[:, -1:]  # [B, 1]
    j = _first_above(block_cdf, target)  # [B, 1] the block holding the target
    before = torch.where(j > 0, block_cdf.gather(1, (j - 1).clamp_min(0)), 0.0)  # [B, 1] mass before it
    cols = j * _BLOCK + torch.arange(_BLOCK, device=weights.device)  # [B, BLOCK]
    inside = weights.gather(1, cols.clamp_max(V - 1)).masked_fill(cols >= V, 0.0)  # [B, BLOCK]
    k = _first_above(inside.cumsum(1, dtype=torch.float64), target - before)  # [B, 1]
    return (j * _BLOCK + k).squeeze(1)  # [B]


def sample(logits: torch.Tensor, rows: RowParams, shared: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (tokens [B] long, logprobs [B] float32)."""
    logits = logits.float()  # [B, V]
    B = logits.shape[0]
    z = logits if rows.unit_temps else logits / rows.temps  # [B, V]
    zmax = z.amax(dim=-1, keepdim=True)  # [B, 1]
    e = (z - zmax).exp_()  # [B, V] unnormalised probabilities
    total = e.sum(dim=-1, keepdim=True)  # [B, 1]
    any_greedy = rows.unseeded.numel() + len(rows.seeded) < B
    tokens = logits.argmax(dim=-1) if any_greedy else None  # [B]
    if not rows.all_greedy:
        weights, idx = e, None
        if rows.need_filter:
            weights, idx = _filtered_probs(e / total, rows)  # sorted, filtered: zeros drop tokens
        choice = _draw(weights, _uniforms(rows, B, shared, logits.device))  # [B]
        if idx is not None:
            choice = idx.gather(1, choice[:, None]).squeeze(1)  # [B] back to vocabulary ids
        tokens = torch.where(rows.greedy, tokens, choice) if any_greedy else choice  # [B]
    lse = zmax.squeeze(1) + total.squeeze(1).log()  # [B] logsumexp(z)
    lp = z.gather(1, tokens[:, None]).squeeze(1) - lse  # [B]
    return tokens, lp
