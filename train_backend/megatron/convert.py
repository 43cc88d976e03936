"""HF llama-family tensors <-> megatron-core GPTModel tensors.

Pure tensor functions on *full* (unsharded) tensors plus TP sharding, keyed by megatron parameter
name with *global* layer numbers (``decoder.layers.7.mlp.linear_fc1.weight``):

* names: ``model.layers.i.self_attn.q_proj.weight`` ... <-> ``decoder.layers.i.self_attention...``
* fused QKV: megatron stores ``[groups, (q_per_group + 2) * head_dim, hidden]``: each KV group's
  query heads, then its key head, then its value head (same for the Qwen2 biases);
* fused gate/up: ``linear_fc1 = [gate; up]``, and each TP shard is ``[gate_shard; up_shard]``;
* vocabulary padding: embedding / output rows beyond the HF vocabulary are zero and dropped on
  export;
* TransformerEngine's fused-norm names (``linear_qkv.layer_norm_weight``,
  ``linear_fc1.layer_norm_weight``) are accepted as aliases of the local spec's norm names.

Model-level loading/export (which also deals with PP stages and communication) lives in
:mod:`train_backend.megatron.checkpoint`.
"""

from __future__ import annotations

import re

import torch

from train_backend.megatron.model import ModelDims

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# per-layer megatron suffix -> HF suffix (1:1 tensors)
_LAYER_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE fused norm
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",  # TE fused norm
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
# TP partition dim of each megatron tensor (absent = replicated)
_PARTITION_DIM = {
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
}


def split_layer_name(name: str) -> tuple[int | None, str]:
    """``decoder.layers.3.x`` -> ``(3, 'x')``; other names -> ``(None, name)``."""
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def hf_names(name: str, dims: ModelDims) -> list[str]:
    """The HF tensor names that make up megatron tensor ``name`` (global layer numbering)."""
    layer, suffix = split_layer_name(name)
    if layer is None:
        if name in ("embedding.word_embeddings.weight",):
            return ["model.embed_tokens.weight"]
        if name == "output_layer.weight":
            return ["model.embed_tokens.weight" if dims.tied_embeddings else "lm_head.weight"]
        if name == "decoder.final_layernorm.weight":
            return ["model.norm.weight"]
        raise ValueError(f"unknown megatron parameter {name!r}")
    p = f"model.layers.{layer}."
    if suffix in _LAYER_SIMPLE:
        return [p + _LAYER_SIMPLE[suffix]]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        return [f"{p}self_attn.{x}_proj.{kind}" for x in ("q", "k", "v")]
    if suffix == "mlp.linear_fc1.weight":
        return [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
    raise ValueError(f"unknown megatron parameter {name!r}")


def _is_vocab(name: str) -> bool:
    return name in ("embedding.word_embeddings.weight", "output_layer.weight")


def hf_to_mcore(name: str, hf: list[torch.Tensor], dims: ModelDims) -> torch.Tensor:
    """Full megatron tensor ``name`` from the HF tensors listed by :func:`hf_names`."""
    _, suffix = split_layer_name(name)
    if _is_vocab(name):
        (w,) = hf  # [V, h]
        pad = dims.padded_vocab_size - w.shape[0]
        if pad < 0:
            raise ValueError(f"{name}: HF vocab {w.shape[0]} exceeds padded vocab {dims.padded_vocab_size}")
        return torch.cat([w, w.new_zeros(pad, w.shape[1])]) if pad else w  # [Vp, h]
    if suffix.startswith("self_attention.linear_qkv.") and len(hf) == 3:
        q, k, v = hf  # [nh*hd, (h)], [ng*hd, (h)], [ng*hd, (h)]
        g, hd = dims.num_kv_heads, dims.head_dim
        rest = q.shape[1:]
        qkv = torch.cat([q.reshape(g, -1, hd, *rest), k.reshape(g, 1, hd, *rest),
                         v.reshape(g, 1, hd, *rest)], dim=1)  # [ng, qpg+2, hd, (h)]
        return qkv.reshape(-1, *rest)  # [ng*(qpg+2)*hd, (h)]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = hf  # [ffn, h] each
        return torch.cat([gate, up])  # [2*ffn, h]
    (w,) = hf
    return w


def mcore_to_hf(name: str, full: torch.Tensor, dims: ModelDims) -> list[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs from full megatron tensor ``name`` (inverse of :func:`hf_to_mcore`)."""
    names = hf_names(name, dims)
    _, suffix = split_layer_name(name)
    if _is_vocab(name):
        return [(names[0], full[: dims.vocab_size])]  # [V, h]
    if suffix.startswith("self_attention.linear_qkv.") and len(names) == 3:
        g, hd = dims.num_kv_heads, dims.head_dim
        qpg = dims.num_heads // g
        rest = full.shape[1:]
        qkv = full.reshape(g, qpg + 2, hd, *rest)  # [ng, qpg+2, hd, (h)]
        q = qkv[:, :qpg].reshape(-1, *rest)  # [nh*hd, (h)]
        k = qkv[:, qpg].reshape(-1, *rest)  # [ng*hd, (h)]
        v = qkv[:, qpg + 1].reshape(-1, *rest)  # [ng*hd, (h)]
        return list(zip(names, (q.contiguous(), k.contiguous(), v.contiguous())))
    if suffix == "mlp.linear_fc1.weight":
        gate, up = full.chunk(2)  # [ffn, h] each
        return [(names[0], gate.contiguous()), (names[1], up.contiguous())]
    return [(names[0], full)]


def partition_dim(name: str) -> int | None:
    """TP partition dimension of megatron tensor ``name`` (None = replicated on every TP rank)."""
    if _is_vocab(name):
        return 0
    _, suffix = split_layer_name(name)
    return _PARTITION_DIM.get(suffix)


def tp_shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's shard of full megatron tensor ``name``."""
    dim = partition_dim(name)
    if dim is None or size == 1:
        return full
    if full.shape[dim] % size:
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} is not divisible by TP={size}")
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = full.chunk(2)  # [ffn, h] each
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])  # [2*ffn/tp, h]
    return full.chunk(size, dim=dim)[rank].contiguous()


def tp_unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Full megatron tensor ``name`` from all TP ranks' shards (inverse of :func:`tp_shard`)."""
    dim = partition_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("mlp.linear_fc1.weight"):
        halves = [s.chunk(2) for s in shards]  # per rank: (gate_r, up_r)
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])  # [2*ffn, h]
    return torch.cat(shards, dim=dim)
