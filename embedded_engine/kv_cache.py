"""A batched, left-padded KV cache with preallocated capacity.

Every row of the running batch shares one cache length ``T``; a row's own tokens sit at the
right end of it (left padding), and ``valid [B, T]`` marks which columns hold real tokens. A
decode step writes one column in place (no ``torch.cat`` of the whole cache per step, which is
what makes transformers' DynamicCache quadratic). Rows join by ``merge`` (right-aligned copy into
a fresh buffer) and leave by ``select`` (gather of the surviving rows, dropping leading columns
that no surviving row uses).

The object implements the small part of transformers' cache protocol that decoder layers call:
``update(key_states, value_states, layer_idx, **kwargs) -> (keys, values)``.
"""

from __future__ import annotations

import torch


class BatchKVCache:
    """Per-layer K/V buffers ``[B, H_kv, capacity, D]``; ``length`` columns are filled."""

    def __init__(self, num_layers: int, keys: list[torch.Tensor] | None = None,
                 values: list[torch.Tensor] | None = None, length: int = 0):
        self.num_layers = num_layers
        self.keys: list[torch.Tensor] = keys or []
        self.values: list[torch.Tensor] = values or []
        self.length = length
        self._end = length  # length after the forward in progress

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def begin(self, q_len: int, max_capacity: int) -> None:
        """Reserve room for ``q_len`` new columns before a forward (grows by doubling)."""
        self._end = self.length + q_len
        if self.keys and self._end > self.capacity:
            cap = min(max(self._end, 2 * self.capacity), max(max_capacity, self._end))
            self.keys = [_regrow(k, self.length, cap) for k in self.keys]
            self.values = [_regrow(v, self.length, cap) for v in self.values]

    def commit(self) -> None:
        """Make the columns written by the last forward part of the cache."""
        self.length = self._end

    # --- the transformers cache protocol (what LlamaAttention & co. call) -----------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, q, D]`` states at the current end; return the filled ``[B, H, end, D]`` views."""
        if layer_idx == len(self.keys):  # first forward: allocate with a little headroom
            B, H, q, D = key_states.shape
            cap = max(self._end, 16) + 16
            self.keys.append(key_states.new_empty((B, H, cap, D)))
            self.values.append(value_states.new_empty((B, H, cap, D)))
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[:, :, self.length:self._end] = key_states
        v[:, :, self.length:self._end] = value_states
        return k[:, :, :self._end], v[:, :, :self._end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    # --- batch membership ------------------------------------------------------------------
    def select(self, rows: torch.Tensor, trim_left: int) -> "BatchKVCache":
        """A new cache holding ``rows`` (``[n]`` long) without the first ``trim_left`` columns."""
        keys = [k[rows, :, trim_left:self.length].contiguous() for k in self.keys]
        values = [v[rows, :, trim_left:self.length].contiguous() for v in self.values]
        return BatchKVCache(self.num_layers, keys, values, self.length - trim_left)

    @staticmethod
    def merge(a: "BatchKVCache", a_rows: torch.Tensor, a_trim: int, b: "BatchKVCache") -> "BatchKVCache":
        """Rows ``a_rows`` of ``a`` (minus ``a_trim`` leading columns) then all rows of ``b``,
        right-aligned to a common length."""
        la, lb = a.length - a_trim, b.length
        T = max(la, lb)
        na, nb = a_rows.numel(), b.keys[0].shape[0]
        keys, values = [], []
        for src_a, src_b, out in ((a.keys, b.keys, keys), (a.values, b.values, values)):
            for xa, xb in zip(src_a, src_b):
                _, H, _, D = xb.shape
                buf = xb.new_zeros((na + nb, H, T + 16, D))
                buf[:na, :, T - la:T] = xa[a_rows, :, a_trim:a.length]
                buf[na:, :, T - lb:T] = xb[:, :, :lb]
                out.append(buf)
        return BatchKVCache(a.num_layers, keys, values, T)


    @staticmethod
    def stack(parts: list[tuple[torch.Tensor, "BatchKVCache"]], n: int) -> "BatchKVCache":
        """One cache of ``n`` rows from caches of a split prefill: part ``(rows, cache)`` fills rows
        ``rows`` (``[k]`` long), right-aligned to the longest. Pad columns are zero (finite: a
        masked column must not carry NaN into the attention's weighted sum)."""
        T = max(c.length for _, c in parts)
        first = parts[0][1]
        keys, values = [], []
        for layer in range(len(first.keys)):
            for src, out in ((lambda c: c.keys[layer], keys), (lambda c: c.values[layer], values)):
                _, H, _, D = src(first).shape
                buf = src(first).new_zeros((n, H, T + 16, D))
                for rows, c in parts:
                    buf[rows, :, T - c.length:T] = src(c)[:, :, :c.length]
                out.append(buf)
        return BatchKVCache(first.num_layers, keys, values, T)


def _regrow(x: torch.Tensor, length: int, cap: int) -> torch.Tensor:
    B, H, _, D = x.shape
    out = x.new_empty((B, H, cap, D))
    out[:, :, :length] = x[:, :, :length]
    return out
