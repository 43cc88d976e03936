"""Run micro-batches through megatron-core's pipeline schedules, and vocab-parallel log-probs.

Batches are right-padded token matrices: every micro-batch has the same ``[b, T]`` shape because
pipeline stages exchange fixed-shape activations. Causal attention makes right padding
harmless (see :mod:`train_backend.megatron.attention`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

# loss_fn(micro_batch, logits [b, T, V/tp]) -> (loss scalar, stats dict)
LossFn = Callable[["MicroBatch", torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


@dataclass
class MicroBatch:
    """One micro-batch: ``tokens`` ``[b, T]`` right-padded; ``rows`` = indices of its samples in
    the caller's list (``-1`` for filler rows); ``extra`` carries per-row loss inputs."""

    tokens: torch.Tensor  # [b, T]
    lengths: list[int]
    rows: list[int]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def position_ids(self) -> torch.Tensor:
        b, t = self.tokens.shape
        return torch.arange(t, device=self.tokens.device).unsqueeze(0).expand(b, t)  # [b, T]


def make_micro_batches(seqs: list[list[int]], max_tokens: int, device: torch.device,
                       pad_to_multiple: int = 8, pad_id: int = 0) -> list[MicroBatch]:
    """Pack sequences (in order) into equal-shape micro-batches of at most ``max_tokens`` tokens.

    ``T`` = the longest sequence rounded up to ``pad_to_multiple``; ``b = max(1, max_tokens // T)``;
    the last micro-batch is filled with one-token filler rows (``rows == -1``).
    """
    if not seqs:
        raise ValueError("make_micro_batches: no sequences")
    t = max(len(s) for s in seqs)
    t = -(-t // pad_to_multiple) * pad_to_multiple
    b = max(1, max_tokens // t)
    out = []
    for start in range(0, len(seqs), b):
        chunk = list(range(start, min(start + b, len(seqs))))
        tokens = torch.full((b, t), pad_id, dtype=torch.long)  # [b, T]
        lengths, rows = [], []
        for r in range(b):
            if r < len(chunk):
                s = seqs[chunk[r]]
                tokens[r, : len(s)] = torch.tensor(s, dtype=torch.long)
                lengths.append(len(s))
                rows.append(chunk[r])
            else:
                lengths.append(1)
                rows.append(-1)
        out.append(MicroBatch(tokens.to(device), lengths, rows))
    return out


def run_pipeline(model: list[torch.nn.Module], micro_batches: list[MicroBatch], loss_fn: LossFn,
                 forward_only: bool) -> list[dict[str, Any]]:
    """Forward (and backward unless ``forward_only``) all micro-batches through the pipeline.

    Returns the stats dicts of ``loss_fn`` on the last pipeline stage, ``[]`` elsewhere. The loss
    returned by ``loss_fn`` is back-propagated as is (``calculate_per_token_loss`` is on, so
    megatron does not rescale it): make it the micro-batch's share of the global loss.
    """
    if not micro_batches:
        raise ValueError("run_pipeline: no micro-batches")
    b, t = micro_batches[0].tokens.shape
    for mb in micro_batches:
        if tuple(mb.tokens.shape) != (b, t):
            raise ValueError("run_pipeline: micro-batches must share one [b, T] shape")

    def forward_step(data_iterator: Any, chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        output = chunk(mb.tokens, mb.position_ids, None)  # last stage: [b, T, V/tp]; else hidden

        def loss(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            value, stats = loss_fn(mb, out)
            return value, torch.ones((), dtype=torch.int, device=value.device), stats

        return output, loss

    fb = get_forward_backward_func()
    return fb(forward_step_func=forward_step, data_iterator=iter(micro_batches), model=model,
              num_microbatches=len(micro_batches), seq_length=t, micro_batch_size=b,
              forward_only=forward_only)


def masked_vocab_logits(logits: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """A fresh fp32 ``logits / temperature`` with this TP rank's padded-vocabulary columns at -inf.

    logits: ``[..., V_padded / tp]`` (this rank's vocabulary slice, any float dtype). The result
    never aliases ``logits``, so callers may modify it in place (megatron's vocab-parallel cross
    entropy does).
    """
    if temperature == 1.0:
        out = logits.to(torch.float32, copy=True)  # [..., Vp/tp]
    else:
        out = logits.float() / temperature  # [..., Vp/tp]
    part = out.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * part
    n_pad = max(0, min(part, start + part - vocab_size))
    if n_pad:
        # Padding rows are not real tokens: keep them out of the softmax (as HF/the engine do).
        # In place: ``out`` is fresh and neither the copy's nor the division's backward needs it.
        out[..., part - n_pad:] = float("-inf")
    return out


def flat_log_probs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                   temperature: float) -> torch.Tensor:
    """``[N, Vp/tp]`` vocab-parallel logits, ``[N]`` targets -> ``[N]`` log-probs (differentiable)."""
    x = masked_vocab_logits(logits, vocab_size, temperature)  # [N, Vp/tp]
    return -tensor_parallel.vocab_parallel_cross_entropy(x, targets)  # [N]


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int,
                    temperature: float) -> torch.Tensor:
    """Log-prob of each next token, engine-style (log-softmax of logits / temperature).

    logits ``[b, T, Vp/tp]`` (vocab-parallel), tokens ``[b, T]`` -> ``[b, T-1]``: entry ``t`` is
    ``log p(tokens[t+1] | tokens[:t+1])``. Differentiable; exact under TP (megatron's
    vocab-parallel cross entropy).
    """
    x = masked_vocab_logits(logits[:, :-1], vocab_size, temperature)  # [b, T-1, Vp/tp]
    target = tokens[:, 1:]  # [b, T-1]
    return -tensor_parallel.vocab_parallel_cross_entropy(x.transpose(0, 1).contiguous(),
                                                         target.transpose(0, 1).contiguous()).transpose(0, 1)  # [b, T-1]


def flat_entropy(logits: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """Entropy of the tempered next-token distribution, ``[..., Vp/tp]`` -> ``[...]`` (TP-exact,
    differentiable)."""
    return entropy_of_masked(masked_vocab_logits(logits, vocab_size, temperature))


def entropy_of_masked(x: torch.Tensor) -> torch.Tensor:
    """Entropy from :func:`masked_vocab_logits`' output ``[..., Vp/tp]`` -> ``[...]`` (reads ``x`` only)."""
    group = parallel_state.get_tensor_model_parallel_group()
    with torch.no_grad():
        m = x.max(dim=-1, keepdim=True).values  # [..., 1]
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = torch.nan_to_num(x - m, neginf=0.0)  # [..., Vp/tp]; padded columns -> 0
    e = torch.exp(x - m)  # [..., Vp/tp]; padded columns -> 0
    reduce = tensor_parallel.reduce_from_tensor_model_parallel_region
    z = reduce(e.sum(-1))  # [...]
    ex = reduce((e * shifted).sum(-1))  # [...]
    return torch.log(z) - ex / z  # [...]


def gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary logits ``[b, T, V]`` from the vocab-parallel ``[b, T, Vp/tp]`` (no grad)."""
    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)  # [b, T, Vp]
    return full[..., :vocab_size]


__all__ = ["MicroBatch", "make_micro_batches", "run_pipeline", "token_log_probs", "flat_log_probs", "flat_entropy",
           "entropy_of_masked", "gather_vocab", "masked_vocab_logits"]
