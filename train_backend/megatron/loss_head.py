"""Memory-lean, TP-exact log-probs and entropies of the tempered next-token distribution.

The plain path (:func:`train_backend.megatron.forward.masked_vocab_logits` + megatron's
``vocab_parallel_cross_entropy`` + :func:`~train_backend.megatron.forward.entropy_of_masked`)
materialises several fp32 ``[N, V]`` tensors per micro-batch (at N = 16k tokens and a 152k
vocabulary each is 10 GB) and keeps the fp32 softmax alive until backward. Here one
:class:`torch.autograd.Function` walks the selected rows in chunks:

- forward: per chunk, fp32 math on the bf16 logits gives four numbers per token (this rank's max,
  sum of exponentials, sum of ``exp * shifted logit`` for the entropy, and the target's logit when
  this rank owns it); after all chunks, the TP ranks combine them (one ``MAX`` and one ``SUM``
  all-reduce of ``[N]``-sized vectors, as megatron's vocab-parallel cross entropy does). It saves
  only the logits (already alive), the row/target indices and two ``[N]`` vectors: the
  log-normaliser and the entropy.
- backward: per chunk, the softmax is recomputed from the logits and the gradient written
  straight into a ``[M, V/tp]`` buffer in the logits' dtype; no fp32 ``[N, V]`` tensor exists.

Semantics are the engine's: log-softmax of ``logits / temperature``; padded-vocabulary columns
(``>= vocab_size``) are excluded from the softmax. ``impl="compiled"`` runs the two per-chunk
kernels through ``torch.compile`` (fused reductions that read each bf16 row a few times instead of
writing fp32 temporaries; for CUDA); ``impl="chunked"`` runs the same math eagerly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

IMPLS = ("unfused", "chunked", "compiled")

# Elements (rows x local vocabulary) per chunk: ~1 GiB of fp32 per temporary at most.
DEFAULT_CHUNK_ELEMENTS = 1 << 28


def _tempered(logits: torch.Tensor, rows: torch.Tensor, temperature: float, n_valid: int) -> torch.Tensor:
    """A fresh fp32 ``logits[rows, :n_valid] / temperature``: ``[c, n_valid]``. Padded-vocabulary
    columns (the tail of the last slice) are sliced off, never masked."""
    x = logits.index_select(0, rows)[:, :n_valid].float()  # [c, n_valid]
    if temperature != 1.0:
        x.div_(temperature)
    return x


def _chunk_stats(logits: torch.Tensor, rows: torch.Tensor, tgt: torch.Tensor, owned: torch.Tensor,
                 temperature: float, n_valid: int, with_entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local per-row statistics of one chunk: max ``m``, ``s = sum exp(x - m)``,
    ``t = sum exp(x - m) (x - m)`` (zeros without entropy) and the target's logit (0 where this
    rank does not own the target). All ``[c]`` fp32. ``n_valid >= 1``."""
    x = _tempered(logits, rows, temperature, n_valid)  # [c, n_valid]
    xt = x.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)  # [c]
    xt = torch.where(owned, xt, torch.zeros_like(xt))  # [c]
    m = x.amax(dim=-1)  # [c]
    d = x.sub_(m.unsqueeze(-1))  # [c, n_valid], in place: x - m
    e = torch.exp(d)  # [c, n_valid]
    s = e.sum(dim=-1)  # [c]
    t = (e.mul_(d)).sum(dim=-1) if with_entropy else torch.zeros_like(s)  # [c]
    return m, s, t, xt


def _chunk_grad(logits: torch.Tensor, rows: torch.Tensor, tgt: torch.Tensor, owned: torch.Tensor,
                lse: torch.Tensor, ent: torch.Tensor, g_logp: torch.Tensor, g_ent: torch.Tensor | None,
                temperature: float, n_valid: int) -> torch.Tensor:
    """d(loss)/d(logits[rows, :n_valid]) of one chunk, in the logits' dtype: ``[c, n_valid]``.

    With ``x = logits / temperature``: ``d logp / dx = onehot - p``, ``d H / dx = -p (log p + H)``;
    the ``1 / temperature`` is folded into the incoming gradients."""
    g_logp = g_logp / temperature  # [c]
    logp_all = _tempered(logits, rows, temperature, n_valid).sub_(lse.unsqueeze(-1))  # [c, n_valid] = log p
    p = torch.exp(logp_all)  # [c, n_valid]
    if g_ent is not None:
        g_ent = g_ent / temperature  # [c]
        # -g_ent p (log p + H) - g_logp p, built in the log p buffer
        coef = logp_all.add_(ent.unsqueeze(-1)).mul_(p).mul_(-g_ent.unsqueeze(-1))  # [c, n_valid]
        coef = coef.addcmul_(p, g_logp.unsqueeze(-1), value=-1.0)  # [c, n_valid]
    else:
        coef = p.mul_(-g_logp.unsqueeze(-1))  # [c, n_valid]
    g_hit = torch.where(owned, g_logp, torch.zeros_like(g_logp))  # [c]
    if torch.compiler.is_compiling():  # one fused pointwise kernel
        hit = torch.arange(coef.shape[-1], device=coef.device).unsqueeze(0) == tgt.unsqueeze(-1)  # [c, n_valid]
        coef = coef + torch.where(hit, g_hit.unsqueeze(-1), torch.zeros_like(coef))  # [c, n_valid]
    else:  # eager: a sparse in-place add (fp32, before the one rounding to the logits' dtype)
        coef.scatter_add_(-1, tgt.unsqueeze(-1), g_hit.unsqueeze(-1))  # [c, n_valid]
    return coef.to(logits.dtype)


_COMPILED: dict[str, Any] = {}


def _kernels(compiled: bool) -> tuple[Any, Any]:
    """The per-chunk functions, eager or through ``torch.compile`` (compiled once per process)."""
    if not compiled:
        return _chunk_stats, _chunk_grad
    if not _COMPILED:
        _COMPILED["stats"] = torch.compile(_chunk_stats, dynamic=True)
        _COMPILED["grad"] = torch.compile(_chunk_grad, dynamic=True)
    return _COMPILED["stats"], _COMPILED["grad"]


class _VocabParallelLogProbs(torch.autograd.Function):
    """``(logits [M, Vl], rows [N], targets [N]) -> (logp [N], entropy [N])``, see module doc."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                temperature: float, with_entropy: bool, entropy_grad: bool, chunk_rows: int,
                compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        part = logits.shape[-1]
        tp = parallel_state.get_tensor_model_parallel_world_size()
        start = parallel_state.get_tensor_model_parallel_rank() * part
        n_valid = max(0, min(part, vocab_size - start))
        local = targets - start  # [N]
        owned = (local >= 0) & (local < n_valid)  # [N]
        tgt = torch.where(owned, local, torch.zeros_like(local))  # [N]
        stats_fn, _ = _kernels(compiled)
        n = rows.numel()
        parts: list[tuple[torch.Tensor, ...]] = []
        if n_valid > 0:
            for i in range(0, n, chunk_rows):
                sl = slice(i, min(n, i + chunk_rows))
                parts.append(stats_fn(logits, rows[sl], tgt[sl], owned[sl], temperature, n_valid, with_entropy))
        if parts:
            m, s, t, xt = (torch.cat([p[k] for p in parts]) for k in range(4))  # [N] each
        else:  # no rows, or this rank's slice is all padding: it contributes nothing
            m = s = t = xt = logits.new_zeros((n,), dtype=torch.float32)
        if tp > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            big = m.clone()  # [N]
            # A slice that is all padding has s == 0: keep its max out of the global one.
            big = torch.where(s > 0, big, torch.full_like(big, float("-inf")))  # [N]
            dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
            w = torch.where(s > 0, torch.exp(m - big), torch.zeros_like(m))  # [N]
            t_rel = torch.where(s > 0, t + (m - big) * s, torch.zeros_like(t))  # [N]; relative to the global max
            packed = torch.stack([s * w, t_rel * w, xt])  # [3, N]
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
            s, t, xt = packed[0], packed[1], packed[2]
            m = big
        log_s = torch.log(s)  # [N]
        lse = m + log_s  # [N]
        logp = xt - lse  # [N]
        ent = log_s - t / s if with_entropy else torch.zeros_like(logp)  # [N]
        ctx.save_for_backward(logits, rows, tgt, owned, lse, ent)
        ctx.temperature, ctx.n_valid, ctx.chunk_rows, ctx.compiled = temperature, n_valid, chunk_rows, compiled
        ctx.entropy_grad = with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:
        logits, rows, tgt, owned, lse, ent = ctx.saved_tensors
        if not ctx.entropy_grad:
            g_ent = None
        if g_logp is None and g_ent is None:
            return (None,) * 9
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        _, grad_fn = _kernels(ctx.compiled)
        grad = torch.zeros_like(logits)  # [M, Vl]; unselected rows and padded columns get none
        n, n_valid = rows.numel(), ctx.n_valid
        for i in range(0, n if n_valid > 0 else 0, ctx.chunk_rows):
            sl = slice(i, min(n, i + ctx.chunk_rows))
            g = grad_fn(logits, rows[sl], tgt[sl], owned[sl], lse[sl], ent[sl], g_logp[sl],
                        None if g_ent is None else g_ent[sl], ctx.temperature, n_valid)  # [c, n_valid]
            grad[:, :n_valid].index_copy_(0, rows[sl], g)
        return grad, None, None, None, None, None, None, None, None


def log_probs_and_entropy(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                          temperature: float, *, with_entropy: bool = True, entropy_grad: bool = False,
                          impl: str = "chunked", chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the tempered distribution at selected rows of vocab-parallel logits.

    ``logits [M, Vp/tp]`` (this TP rank's vocabulary slice, any float dtype; typically the
    ``[b*T, Vp/tp]`` view of a micro-batch's logits), ``rows [N]`` = distinct row indices,
    ``targets [N]`` = global token ids. Returns ``(logp [N], entropy [N] or None)`` in fp32;
    ``logp`` is differentiable, ``entropy`` only with ``entropy_grad`` (else detached).
    ``impl``: ``chunked`` (eager), ``compiled`` (``torch.compile`` of the chunk kernels).
    """
    if impl not in ("chunked", "compiled"):
        raise ValueError(f"log_probs_and_entropy: impl {impl!r} must be chunked or compiled")
    if logits.dim() != 2 or rows.dim() != 1 or rows.shape != targets.shape:
        raise ValueError(f"log_probs_and_entropy: logits [M, V], rows [N], targets [N]; got "
                         f"{tuple(logits.shape)}, {tuple(rows.shape)}, {tuple(targets.shape)}")
    chunk_rows = max(1, chunk_elements // max(1, logits.shape[-1]))
    logp, ent = _VocabParallelLogProbs.apply(logits, rows, targets, vocab_size, temperature, with_entropy,
                                             entropy_grad, chunk_rows, impl == "compiled")
    return logp, (ent if with_entropy else None)


__all__ = ["IMPLS", "DEFAULT_CHUNK_ELEMENTS", "log_probs_and_entropy"]
