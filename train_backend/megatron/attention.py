"""Core attention for megatron-core's local layer spec through torch's SDPA.

megatron-core's own ``DotProductAttention`` (used when TransformerEngine is absent) materialises
the full ``[b, heads, s, s]`` score matrix; at 4k tokens that does not fit. This module keeps the
same constructor and forward signature but calls ``torch.nn.functional.scaled_dot_product_attention``
with ``is_causal=True``, which dispatches to the flash / cuDNN / memory-efficient kernels on GPU
and never builds the score matrix.

Masking contract: sequences are right-padded per row (the backend's batching). With a causal
mask, real tokens never attend to the padding behind them, so no explicit mask is needed; the
outputs at padded positions are garbage and are dropped by the loss mask. Packed sequences
(``packed_seq_params`` with ``cu_seqlens``) are handled by attending within each segment.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


# --sdpa-backend: which of SDPA's kernels to try first (the others stay allowed, in this order,
# for inputs the first one cannot take); auto = torch's own choice.
SDPA_BACKENDS = ("auto", "flash", "cudnn", "efficient")
_PRIORITIES: dict[str, list[SDPBackend] | None] = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH],
    "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                  SDPBackend.MATH],
}


class SDPAttention(MegatronModule):
    """Drop-in ``core_attention`` for megatron-core's local spec (causal self-attention only)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(config=config)
        if backend not in SDPA_BACKENDS:
            raise ValueError(f"--sdpa-backend={backend!r}: expected one of {', '.join(SDPA_BACKENDS)}")
        self.backends = _PRIORITIES[backend]
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention: context parallelism needs TransformerEngine "
                             "(--context-parallel-size must be 1)")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SDPAttention supports causal attention only, got {attn_mask_type}")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.num_heads = divide(config.num_attention_heads, tp)
        self.num_groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.hidden_size_per_partition = self.num_heads * self.head_dim
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [b, np, s, hn]; k, v: [b, ng, s, hn]
        if self.num_groups != self.num_heads:
            # Expand grouped K/V to the query heads (a view-free repeat; kernels need equal heads
            # on every backend, enable_gqa is not accepted by all of them).
            rep = self.num_heads // self.num_groups
            k = k.repeat_interleave(rep, dim=1)  # [b, np, s, hn]
            v = v.repeat_interleave(rep, dim=1)  # [b, np, s, hn]
        if self.backends is not None:
            with sdpa_kernel(self.backends, set_priority=True):
                return self._sdpa_call(q, k, v)
        return self._sdpa_call(q, k, v)

    def _sdpa_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.dropout_p if self.training else 0.0
        if dropout > 0.0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                      scale=self.softmax_scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` -> context ``[sq, b, np*hn]``."""
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        sq, b = query.shape[0], query.shape[1]
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)  # [b, ng, sk, hn]
        v = value.permute(1, 2, 0, 3)  # [b, ng, sk, hn]
        if packed_seq_params is None:
            out = self._sdpa(q, k, v)  # [b, np, sq, hn]
        else:
            if b != 1:
                raise ValueError("SDPAttention: packed sequences need micro-batch size 1")
            cu = packed_seq_params.cu_seqlens_q.tolist()
            if cu[-1] < sq:  # trailing padding: one more (ignored) segment
                cu.append(sq)
            # Each packed segment attends only to itself (causally).
            out = torch.cat([self._sdpa(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e])
                             for s, e in zip(cu[:-1], cu[1:]) if e > s], dim=2)  # [1, np, sq, hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)  # [sq, b, hp]
