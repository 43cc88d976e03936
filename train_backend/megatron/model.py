"""Build a megatron-core ``GPTModel`` from a Hugging Face config of the llama family.

Supported: Llama, Qwen2 (QKV bias), Qwen3 (q/k RMSNorm, explicit head_dim); GQA; tied or untied
embeddings; RoPE theta and any RoPE scaling that only rescales the inverse frequencies
(``default``, ``linear``, ``llama3``, ...: we take them from transformers' own RoPE init
functions, so they match HF exactly); RMSNorm eps. Core attention is TransformerEngine's when it
is installed, else :class:`~train_backend.megatron.attention.SDPAttention`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from train_backend.megatron.attention import SDPAttention

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

try:  # TransformerEngine is optional: it gives fused kernels on GPU.
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except ImportError:
    HAVE_TE = False


@dataclass(frozen=True)
class ModelDims:
    """The architecture facts conversion and the backend need, read once from the HF config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rms_norm_eps: float
    max_position_embeddings: int


def padded_vocab(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron pads the vocabulary so every TP rank holds an equal multiple of ``divisible_by``."""
    if divisible_by < 1:
        raise ValueError(f"--make-vocab-size-divisible-by must be >= 1, got {divisible_by}")
    multiple = divisible_by * tp_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def dims_from_hf(hf_config: Any, make_vocab_size_divisible_by: int, tp_size: int) -> ModelDims:
    """Read :class:`ModelDims` from a transformers config; ``ValueError`` if unsupported."""
    mt = hf_config.model_type
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"--hf-checkpoint: model_type {mt!r} is not supported by the Megatron "
                         f"backend (supported: {SUPPORTED_MODEL_TYPES})")
    if hf_config.hidden_act != "silu":
        raise ValueError(f"--hf-checkpoint: hidden_act {hf_config.hidden_act!r} is not supported (silu only)")
    if mt == "llama" and (hf_config.attention_bias or hf_config.mlp_bias):
        raise ValueError("--hf-checkpoint: llama attention_bias/mlp_bias are not supported")
    if mt == "qwen3" and hf_config.attention_bias:
        raise ValueError("--hf-checkpoint: qwen3 attention_bias is not supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("--hf-checkpoint: sliding-window attention is not supported")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv = hf_config.num_key_value_heads or hf_config.num_attention_heads
    return ModelDims(
        model_type=mt,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        padded_vocab_size=padded_vocab(hf_config.vocab_size, make_vocab_size_divisible_by, tp_size),
        tied_embeddings=bool(hf_config.tie_word_embeddings),
        qkv_bias=(mt == "qwen2"),
        qk_norm=(mt == "qwen3"),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        max_position_embeddings=hf_config.max_position_embeddings,
    )


def hf_inv_freq(hf_config: Any) -> torch.Tensor:
    """RoPE inverse frequencies exactly as transformers computes them (incl. scaling)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = hf_config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        base = float(params["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"--hf-checkpoint: rope_type {rope_type!r} is not supported "
                         "(only scalings that rescale inverse frequencies)")
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    if attention_scaling != 1.0:
        raise ValueError(f"--hf-checkpoint: rope_type {rope_type!r} scales attention "
                         f"({attention_scaling}); not supported")
    return inv_freq.float()


def transformer_config(dims: ModelDims, *, params_dtype: torch.dtype, tp_size: int, pp_size: int,
                       sequence_parallel: bool, on_cpu: bool, recompute: bool = False,
                       bias_swiglu_fusion: bool = False, **overrides: Any) -> TransformerConfig:
    """megatron-core config matching the HF architecture (no dropout, no biases, SwiGLU, RMSNorm).

    ``bias_swiglu_fusion``: megatron-core's SwiGLU autograd function, whose forward and backward
    are ``torch.compile``'d (``megatron.core.jit.jit_fuser``): two fused kernels instead of ~8
    elementwise passes over the ``[tokens, 2 x ffn]`` activation; needs no TE/apex."""
    bf16 = params_dtype == torch.bfloat16
    kw: dict[str, Any] = dict(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim,
        ffn_hidden_size=dims.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=dims.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        qk_layernorm=dims.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # The other fusions need apex/TE kernels; the unfused paths are exact.
        bias_activation_fusion=bias_swiglu_fusion,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        params_dtype=params_dtype,
        bf16=bf16,
        pipeline_dtype=params_dtype,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        sequence_parallel=sequence_parallel and tp_size > 1,
        use_cpu_initialization=on_cpu,
        attention_softmax_in_fp32=True,
        init_method_std=0.02,
        # The backend's losses are already normalised by step-wide denominators: megatron must
        # neither divide them by the micro-batch count nor average gradients over DP ranks.
        calculate_per_token_loss=True,
    )
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    kw.update(overrides)
    return TransformerConfig(**kw)


def layer_spec(dims: ModelDims, use_te: bool | None = None, sdpa_backend: str = "auto") -> ModuleSpec:
    """TransformerEngine spec when TE is installed, else the local spec with SDPA attention
    (``sdpa_backend``: which SDPA kernel to try first, see :mod:`~train_backend.megatron.attention`)."""
    if use_te is None:
        use_te = HAVE_TE
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=dims.qk_norm)
    spec = get_gpt_layer_local_spec(qk_layernorm=dims.qk_norm, normalization="RMSNorm")
    attn = spec.submodules.self_attention.submodules
    core = SDPAttention if sdpa_backend == "auto" else functools.partial(SDPAttention, backend=sdpa_backend)
    spec.submodules.self_attention.submodules = dataclasses.replace(attn, core_attention=core)
    return spec


def build_gpt_model(dims: ModelDims, config: TransformerConfig, hf_config: Any,
                    use_te: bool | None = None, sdpa_backend: str = "auto") -> GPTModel:
    """One pipeline stage of the model (parallel state must be initialised), on its device."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(dims, use_te, sdpa_backend),
        vocab_size=dims.padded_vocab_size,
        max_sequence_length=dims.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=dims.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(hf_config.rope_parameters["rope_theta"]),
    )
    # Replace megatron's inverse frequencies by transformers' (covers every rescaling rope type
    # and removes any float difference in how the base is raised).
    rope = model.rotary_pos_emb
    rope.inv_freq = hf_inv_freq(hf_config).to(rope.inv_freq.device)  # [head_dim / 2]
    if model.post_process and not config.sequence_parallel:
        batch_major_logits(model)
    return model


def batch_major_logits(model: GPTModel) -> None:
    """Make the output layer write its logits batch-major, so that ``GPTModel``'s final
    ``logits.transpose(0, 1).contiguous()`` (``[s, b, V] -> [b, s, V]``) is a no-op instead of a
    copy of the largest tensor of the step (and of its gradient in backward).

    The output layer gets ``[b, s, h]`` hidden states (a small copy) and its ``[b, s, V/tp]``
    result is handed back as the ``[s, b, V/tp]`` view megatron expects. Values are unchanged
    (the same matmul per token). Not with sequence parallelism, where the output layer gathers
    its input along the sequence dimension."""

    def to_batch_major(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0]  # [s, b, h]
        return (hidden.transpose(0, 1).contiguous(), *args[1:]), kwargs  # [b, s, h]

    def back_to_sequence_major(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        logits, bias = output  # [b, s, V/tp]
        return logits.transpose(0, 1), bias  # [s, b, V/tp], a view of batch-major memory

    model.output_layer.register_forward_pre_hook(to_batch_major, with_kwargs=True)
    model.output_layer.register_forward_hook(back_to_sequence_major, with_kwargs=True)


def compile_norms(model: torch.nn.Module) -> int:
    """``torch.compile`` every RMSNorm/LayerNorm module of ``model`` in place (``Module.compile``:
    parameter names and checkpoints are unchanged): fused forward and backward kernels instead of
    the eager op-by-op norm. Returns how many modules were compiled.

    Why not whole transformer layers: megatron-core's layer forward graph-breaks inside its
    activation-offloading context managers (a rank-0 ``warnings.warn`` in ``RowParallelLinear``,
    ``make_viewless_tensor``'s ``.data`` swap), where dynamo cannot resume, so most of each layer
    would silently run eagerly anyway. The norms are graph-break free. (SwiGLU has its own fused
    kernels: ``--bias-swiglu-fusion``.)
    """
    from torch import _dynamo

    norms = [m for m in model.modules() if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm))]
    # All instances share one code object; leave room in case dynamo guards on each instance.
    # (torch < 2.7 calls the limit cache_size_limit.)
    name = "recompile_limit" if hasattr(_dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(_dynamo.config, name, max(getattr(_dynamo.config, name), len(norms) + 8))
    for m in norms:
        m.compile()
    return len(norms)
