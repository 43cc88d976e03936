"""The engine's own forward for llama-family causal LMs (Llama, Qwen2, Qwen3, Mistral).

transformers' modules cost ~25 Python-level calls per layer on top of the arithmetic (decorators,
kwargs plumbing, mask creation, per-projection linears), which is most of a decode step for a
small model on a CPU and most of the kernel launches on a GPU. ``NativeForward`` runs the same
computation straight from the HF model's own parameter tensors: fused q/k/v and gate/up matmuls,
RoPE from the model's ``rotary_emb`` module (every ``rope_type``), SDPA with grouped KV heads,
the engine's ``BatchKVCache``. Inputs are those of the HF call the runner makes (explicit
positions, a boolean ``[B, 1, q, T]`` mask); fp32 results equal transformers' to float round-off.

Weights are read from the parameters at every forward, so every weight-update path keeps
working. Tensors derived from them (a fused ``[q; k; v]`` weight, a oneDNN-packed weight) are
cached under the source parameters' storage address and version counter: an in-place write
(``copy_``, ``_foreach_copy_`` into flat views) bumps the version, a new ``.data`` changes the
address, and either rebuilds that derived tensor at the next forward. Fusion is done on the CPU
only, where the packed copies exist anyway (the fused packed weight replaces three packed ones)
or the layers are small; on an accelerator a fused copy would double the weights' memory and
outlive ``release_memory_occupation``, so the projections stay separate there.

``NativeForward.unsupported(model, context_length)`` says why a model takes transformers' path
(None when the native one applies); the runner chooses once at load.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .kv_cache import BatchKVCache

# HF class name -> whether its attention has per-head q/k RMSNorms (Qwen3)
SUPPORTED_ARCHS = {"LlamaForCausalLM": False, "MistralForCausalLM": False, "Qwen2ForCausalLM": False,
                   "Qwen3ForCausalLM": True}


class PackSpec:
    """When the CPU's oneDNN-packed matmul is used (thresholds: ``model_runner.PackedLinears``)."""

    def __init__(self, min_weight_elements: int, min_rows: int, batch_hint: int):
        self.min_weight_elements = min_weight_elements
        self.min_rows = min_rows
        self.batch_hint = batch_hint


class DerivedTensor:
    """A tensor computed from parameters, rebuilt when any of them is written or replaced.

    The key is each source's (storage address, version counter, shape); the sources it was built
    from are held, so a replaced ``.data`` cannot free its storage and have a new weight land on
    the same address with an equal version (which would make a stale copy look current)."""

    __slots__ = ("get_sources", "build", "key", "value", "held")

    def __init__(self, get_sources: Callable[[], list[torch.Tensor]], build: Callable[[list[torch.Tensor]], torch.Tensor]):
        self.get_sources, self.build = get_sources, build
        self.key: tuple | None = None
        self.value: torch.Tensor | None = None
        self.held: list[torch.Tensor] = []

    def get(self) -> torch.Tensor:
        src = self.get_sources()
        key = tuple((t.data_ptr(), t._version, t.shape) for t in src)
        if key != self.key:
            self.held = [t.detach() for t in src]
            self.value = self.build(self.held)
            self.key = key
        return self.value  # type: ignore[return-value]


class _Linear:
    """``x @ [W_1; ...; W_n]^T + [b_1; ...; b_n]`` for linear layers that share their input.

    Several layers are fused only when ``fuse`` (the CPU); a packed weight is used for inputs of
    at least ``pack.min_rows`` rows when ``pack`` is given and the weight is large enough."""

    def __init__(self, layers: list[torch.nn.Linear], fuse: bool, pack: PackSpec | None):
        self.layers = layers
        self.has_bias = layers[0].bias is not None
        same_bias = all((m.bias is not None) == self.has_bias for m in layers)  # else: not fused
        self.fused = fuse and len(layers) > 1 and same_bias
        n_elem = sum(m.weight.numel() for m in layers)
        packable = pack is not None and n_elem >= pack.min_weight_elements and (self.fused or len(layers) == 1)
        self.pack = pack if packable else None
        weights = lambda: [m.weight for m in layers]  # noqa: E731  (read from the modules at each call)
        biases = lambda: [m.bias for m in layers]  # noqa: E731
        cat = lambda ts: torch.cat(ts, 0) if len(ts) > 1 else ts[0]  # noqa: E731
        # a fused plain copy only where no packed one exists (inputs under min_rows then run the
        # layers one by one: a packed layer's weight is not held a third time)
        self.w = DerivedTensor(weights, cat) if self.fused and self.pack is None else None
        self.b = DerivedTensor(biases, cat) if self.fused and self.has_bias else None
        self.packed = None
        if self.pack is not None:
            hint = self.pack.batch_hint
            self.packed = DerivedTensor(weights, lambda ts: torch.ops.mkldnn._reorder_linear_weight(cat(ts), hint))

    def each(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's output separately (views of one product when fused)."""
        few_rows = self.packed is None or x.numel() < self.pack.min_rows * x.shape[-1]  # type: ignore[union-attr]
        if len(self.layers) > 1 and self.w is None and few_rows:  # no fused product to split
            return [F.linear(x, m.weight, m.bias) for m in self.layers]
        return list(self(x).split([m.out_features for m in self.layers], -1))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.numel() >= self.pack.min_rows * x.shape[-1]:  # type: ignore[union-attr]
            bias = self.b.get() if self.b is not None else (self.layers[0].bias if self.has_bias else None)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed.get(), bias, "none", [], "")
        if self.w is not None:
            return F.linear(x, self.w.get(), self.b.get() if self.b is not None else None)
        if len(self.layers) == 1:
            m = self.layers[0]
            return F.linear(x, m.weight, m.bias)
        return torch.cat([F.linear(x, m.weight, m.bias) for m in self.layers], -1)  # [..., sum(out)]


def _rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op (float32 statistics, weight applied in x's dtype)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's rms_norm: one kernel on CUDA (vs six); in bf16 it rounds once where HF rounds twice."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class _Layer:
    """One decoder layer's modules, resolved once (the parameters are read at each forward)."""

    def __init__(self, layer: torch.nn.Module, qk_norm: bool, fuse: bool, pack: PackSpec | None):
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        self.eps1, self.eps2 = _eps(self.ln1), _eps(self.ln2)
        self.qkv = _Linear([attn.q_proj, attn.k_proj, attn.v_proj], fuse, pack)
        self.o = _Linear([attn.o_proj], fuse, pack)
        self.gate_up = _Linear([mlp.gate_proj, mlp.up_proj], fuse, pack)
        self.down = _Linear([mlp.down_proj], fuse, pack)
        self.act: Callable = F.silu if isinstance(mlp.act_fn, torch.nn.SiLU) else mlp.act_fn
        self.q_norm = attn.q_norm if qk_norm else None
        self.k_norm = attn.k_norm if qk_norm else None
        self.q_eps = _eps(attn.q_norm) if qk_norm else 0.0
        self.k_eps = _eps(attn.k_norm) if qk_norm else 0.0
        self.scaling = float(attn.scaling)


def _fold_sign(sin: torch.Tensor) -> torch.Tensor:
    """rotate_half(x) * sin == roll(x, D/2) * [-sin_1, sin_2]: the sign moved onto sin (exact)."""
    D = sin.shape[-1]
    return torch.cat([-sin[..., : D // 2], sin[..., D // 2:]], -1)


def _repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``[B, Hkv, T, D]`` -> ``[B, Hkv * rep, T, D]``, each KV head repeated for its query heads."""
    B, Hkv, T, D = x.shape
    return x[:, :, None].expand(B, Hkv, rep, T, D).reshape(B, Hkv * rep, T, D)


def _eps(norm: torch.nn.Module) -> float:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if eps is None:
        raise ValueError(f"{type(norm).__name__}: no epsilon attribute")
    return float(eps)


class NativeForward:
    """Prefill/decode forward of a supported HF model without its module machinery.

    ``forward(ids [B, q], pos [B, q], mask [B, 1, q, T] bool, cache, last_only)`` -> logits
    ``[B, q or 1, V]`` (the model's dtype), writing this forward's K/V into ``cache``
    (between the runner's ``cache.begin`` and ``cache.commit``)."""

    # decode attention on the CPU as matmul + softmax + matmul instead of SDPA (see forward)
    MATMUL_DECODE_ATTENTION_ON_CPU = True

    # RoPE types whose tables do not depend on the sequence length (dynamic and longrope do)
    STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
    MAX_ROPE_TABLE_POSITIONS = 1 << 16  # longer contexts call the rotary module at every forward

    def __init__(self, model: torch.nn.Module, pack: PackSpec | None, accelerator: bool | None = None,
                 context_length: int | None = None):
        """``pack``: oneDNN packing thresholds (CPU float32) or None. ``accelerator`` (default: the
        model is not on the CPU) picks the kernels: on the CPU fused q/k/v and gate/up weights,
        HF's op-for-op RMSNorm, matmul decode attention; on an accelerator separate projections
        (no weight copies), one-kernel norms, SDPA with K/V repeated for GQA under a mask.
        ``context_length``: positions of the cos/sin table (None: call the rotary module each time)."""
        cfg = model.config.get_text_config()
        accel = model.device.type != "cpu" if accelerator is None else accelerator
        fuse = not accel
        self.model = model
        base = model.model
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.final_norm, self.final_eps = base.norm, _eps(base.norm)
        qk_norm = SUPPORTED_ARCHS[type(model).__name__]
        layers = list(base.layers)[: cfg.num_hidden_layers]
        self.layers = [_Layer(m, qk_norm, fuse, pack) for m in layers]
        self.lm_head = _Linear([model.lm_head], fuse, pack)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(layers[0].self_attn.head_dim)
        self.fused = fuse
        self.packed = pack is not None
        # one kernel per norm on an accelerator (launch-bound); HF's exact op sequence on the CPU
        self.norm = _rms_norm_fused if accel else _rms_norm_hf
        self.matmul_decode_attention = not accel and self.MATMUL_DECODE_ATTENTION_ON_CPU
        # CUDA's fused SDPA kernels take no grouped K/V together with a mask (math fallback)
        self.repeat_kv_prefill = accel
        self.rope_table = self._rope_table(context_length)

    def _rope_table(self, n: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sign-folded sin) ``[n, D]`` from the model's own rotary module, for positions 0..n-1:
        one gather per forward instead of the module's ~8 ops. None where the table would depend on
        the sequence length or be large."""
        if n is None or n > self.MAX_ROPE_TABLE_POSITIONS or getattr(self.rotary, "rope_type", None) not in self.STATIC_ROPE_TYPES:
            return None
        w = self.embed.weight
        with torch.inference_mode():
            cos, sin = self.rotary(w.new_empty((1, n, 1)), torch.arange(n, device=w.device)[None])  # [1, n, D]
        return cos[0].clone(), _fold_sign(sin[0]).clone()

    @staticmethod
    def unsupported(model: torch.nn.Module, context_length: int) -> str | None:
        """Why ``model`` cannot use the native forward (None: it can)."""
        name = type(model).__name__
        if name not in SUPPORTED_ARCHS:
            return f"architecture {name} (native: {', '.join(sorted(SUPPORTED_ARCHS))})"
        cfg = model.config.get_text_config()
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "rotary_emb") or not hasattr(base, "layers"):
            return f"{name} without model.rotary_emb / model.layers"
        window = getattr(cfg, "sliding_window", None)
        kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if name == "MistralForCausalLM":
            kinds = {"sliding_attention"} if window is not None else {"full_attention"}
        if "sliding_attention" in kinds and window is not None and window < context_length:
            return f"sliding-window attention (window {window} < context length {context_length})"
        if kinds - {"full_attention", "sliding_attention"}:
            return f"layer types {sorted(kinds)}"
        if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "attn_logit_softcapping", None):
            return "logit soft-capping"
        for i, layer in enumerate(base.layers):
            attn = getattr(layer, "self_attn", None)
            mlp = getattr(layer, "mlp", None)
            need = [(attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"),
                    (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj")]
            if any(type(getattr(m, a, None)) is not torch.nn.Linear for m, a in need):
                return f"layer {i}: projections are not plain nn.Linear (quantized or adapted?)"
            if not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm")):
                return f"layer {i}: no input/post-attention norms"
            if not hasattr(attn, "scaling") or not hasattr(attn, "head_dim"):
                return f"layer {i}: attention without scaling/head_dim"
        if type(getattr(model, "lm_head", None)) is not torch.nn.Linear:
            return "lm_head is not a plain nn.Linear"
        return None

    # --- the forward ------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: BatchKVCache,
                last_only: bool) -> torch.Tensor:
        B, q = ids.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        norm = self.norm
        h = F.embedding(ids, self.embed.weight)  # [B, q, E]
        if self.rope_table is not None:
            cos, sin = self.rope_table[0][pos], self.rope_table[1][pos]  # [B, q, D] each
        else:
            cos, sin = self.rotary(h, pos)  # [B, q, D] each, h's dtype
            sin = _fold_sign(sin)
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, q, 1, D]: broadcast over heads
        rep = H // Hkv
        # CPU decode: attention as two batched matmuls around an additive mask built once per
        # forward; for one query row per KV head group this beats SDPA's flash kernel (bench/NOTES.md)
        bias = None
        if q == 1 and self.matmul_decode_attention:
            bias = torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill_(~mask, float("-inf"))
        for i, L in enumerate(self.layers):
            x = norm(h, L.ln1.weight, L.eps1)
            qkv = L.qkv(x).view(B, q, H + 2 * Hkv, D)  # [B, q, H + 2 Hkv, D]
            if L.q_norm is None:  # RoPE on q and k together
                qk = qkv[:, :, : H + Hkv]
                qk = torch.addcmul(qk * cos, torch.roll(qk, D // 2, -1), sin)  # [B, q, H + Hkv, D]
                qh, kh = qk[:, :, :H], qk[:, :, H:]
            else:  # Qwen3: per-head RMSNorm of q and k before RoPE
                qh = norm(qkv[:, :, :H], L.q_norm.weight, L.q_eps)
                kh = norm(qkv[:, :, H:H + Hkv], L.k_norm.weight, L.k_eps)
                qh = torch.addcmul(qh * cos, torch.roll(qh, D // 2, -1), sin)
                kh = torch.addcmul(kh * cos, torch.roll(kh, D // 2, -1), sin)
            vh = qkv[:, :, H + Hkv:]  # [B, q, Hkv, D]
            k_all, v_all = cache.update(kh.transpose(1, 2), vh.transpose(1, 2), i)  # [B, Hkv, T, D]
            if q == 1:  # decode: the rep query heads of a KV head as a length-rep query (no K/V copy)
                qg = qh.reshape(B, Hkv, rep, D)
                if bias is not None:
                    w = torch.add(bias, torch.matmul(qg, k_all.transpose(-1, -2)), alpha=L.scaling)  # [B, Hkv, rep, T]
                    o = torch.matmul(w.softmax(-1), v_all)  # [B, Hkv, rep, D]
                else:
                    o = F.scaled_dot_product_attention(qg, k_all, v_all, attn_mask=mask, scale=L.scaling)
                o = o.reshape(B, 1, H * D)
            else:
                if rep > 1 and self.repeat_kv_prefill:
                    k_all, v_all = _repeat_kv(k_all, rep), _repeat_kv(v_all, rep)  # [B, H, T, D]
                o = F.scaled_dot_product_attention(qh.transpose(1, 2), k_all, v_all, attn_mask=mask,
                                                   scale=L.scaling, enable_gqa=k_all.shape[1] != H)  # [B, H, q, D]
                o = o.transpose(1, 2).reshape(B, q, H * D)
            h = h + L.o(o)
            x = norm(h, L.ln2.weight, L.eps2)
            gate, up = L.gate_up.each(x)  # [B, q, I] each
            h = h + L.down(L.act(gate) * up)
        if last_only:
            h = h[:, -1:]
        return self.lm_head(norm(h, self.final_norm.weight, self.final_eps))  # [B, q', V]

    def prepare(self) -> None:
        """Build every fused/packed weight now (the first request would pay for it otherwise)."""
        for lin in [lin for L in self.layers for lin in (L.qkv, L.o, L.gate_up, L.down)] + [self.lm_head]:
            for d in (lin.w, lin.b, lin.packed):
                if d is not None:
                    d.get()
