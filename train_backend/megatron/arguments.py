"""Command-line flags of the Megatron backend (slime's / Megatron-LM's names) and their settings.

The launcher calls :func:`add_arguments` beside the torch half's ``train_backend/arguments.py``;
:func:`settings_from_args` builds and validates :class:`MegatronSettings`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from flags import SettingError, add_flags, flag, from_args, section

TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
LOSS_HEADS = ("auto", "unfused", "chunked", "compiled")  # see train_backend/megatron/loss_head.py
SDPA_BACKENDS = ("auto", "flash", "cudnn", "efficient")  # = train_backend.megatron.attention.SDPA_BACKENDS
# Megatron's --attention-backend -> the SDPA kernel tried first (fused = cuDNN's fused attention)
ATTENTION_BACKENDS = {"auto": "auto", "flash": "flash", "fused": "cudnn"}
# slime's model flags whose only meaningful value here is the one given (dense models, no dropout)
_ONLY = {"context_parallel_size": (1, "no context parallelism: sequences are packed per data-parallel rank"),
         "expert_model_parallel_size": (1, "the backend builds dense GPT models (no MoE experts)"),
         "expert_tensor_parallel_size": (1, "the backend builds dense GPT models (no MoE experts)"),
         "hidden_dropout": (0.0, "RL trains without dropout: old, reference and new log-probs must come from "
                                 "the same function (slime's scripts set 0)"),
         "attention_dropout": (0.0, "RL trains without dropout: old, reference and new log-probs must come "
                                    "from the same function (slime's scripts set 0)")}


def _only(name: str) -> str:
    only, why = _ONLY[name]
    return f"slime's flag; only {only} ({why})"


@dataclass
class MegatronSettings:
    """Parallel layout and Megatron-specific knobs; each field declares its flag (:mod:`flags`)."""

    tensor_model_parallel_size: int = flag(1, "tensor-parallel ranks per model replica", group="megatron backend")
    pipeline_model_parallel_size: int = flag(1, "pipeline stages per model replica")
    sequence_parallel: bool = flag(False, "shard activations along the sequence inside TP regions")
    use_distributed_optimizer: bool = flag(False, "shard optimizer state and fp32 master weights over data-parallel "
                                           "ranks")
    make_vocab_size_divisible_by: int = flag(128, "pad the vocabulary to a multiple of this x TP size")
    recompute_activations: bool = flag(False, "recompute every layer's activations in backward (full, uniform, 1 "
                                       "layer)")
    transformer_impl: str = flag("auto", "layer implementation: TransformerEngine (auto: if installed) or "
                                 "megatron-core local layers + SDPA", choices=TRANSFORMER_IMPLS)
    # unfused = fp32 [N, V] copies + megatron's vocab-parallel cross entropy; chunked = one
    # memory-lean autograd function over token chunks; compiled = the same with its chunk kernels
    # through torch.compile (fused reductions; meant for CUDA; compiling would only slow small CPU runs)
    loss_head: str = flag("auto", "log-prob/entropy computation over the vocabulary: unfused (fp32 [N, V] copies), "
                          "chunked (memory-lean, recomputes the softmax in backward), compiled (chunked with "
                          "torch.compile'd kernels; for CUDA) or auto (compiled on CUDA, chunked on the CPU)",
                          choices=LOSS_HEADS)
    # CUDA speed-ups that need neither TE nor apex (bench/train measures them); None = on with CUDA
    bias_swiglu_fusion: bool | None = flag(None, "megatron-core's fused (torch.compile'd) SwiGLU activation; no "
                                           "TE/apex needed (default: on with CUDA)")
    torch_compile: bool | None = flag(None, "torch.compile the RMSNorm modules (fused kernels; the first step "
                                      "compiles; default: on with CUDA)")
    sdpa_backend: str = flag("auto", "local layers: the scaled_dot_product_attention kernel to try first (auto = "
                             "torch's default order)", choices=SDPA_BACKENDS)
    fused_adam: bool = flag(False, "torch's fused AdamW kernel (without TE/apex megatron-core uses torch's foreach "
                            "AdamW)")
    # slime's / Megatron-LM's flags (see _ONLY for the values that can be honoured)
    attention_backend: str = flag("auto", "Megatron's name for the attention kernel: flash / fused pick SDPA's flash "
                                  "/ cuDNN kernel first", choices=tuple(ATTENTION_BACKENDS))
    context_parallel_size: int = flag(1, _only("context_parallel_size"))
    expert_model_parallel_size: int = flag(1, _only("expert_model_parallel_size"))
    expert_tensor_parallel_size: int = flag(1, _only("expert_tensor_parallel_size"))
    hidden_dropout: float = flag(0.0, _only("hidden_dropout"))
    attention_dropout: float = flag(0.0, _only("attention_dropout"))

    def __post_init__(self) -> None:
        self.validate()

    def for_device(self, device_type: str) -> "MegatronSettings":
        """A copy with every ``auto``/``None`` choice made for ``device_type`` (``cuda`` or ``cpu``)."""
        cuda = device_type == "cuda"
        sdpa = ATTENTION_BACKENDS.get(self.attention_backend, "auto") if self.sdpa_backend == "auto" else self.sdpa_backend
        return dataclasses.replace(
            self, sdpa_backend=sdpa, loss_head=("compiled" if cuda else "chunked") if self.loss_head == "auto" else self.loss_head,
            bias_swiglu_fusion=cuda if self.bias_swiglu_fusion is None else self.bias_swiglu_fusion,
            torch_compile=cuda if self.torch_compile is None else self.torch_compile)

    def validate(self) -> None:
        """Raise :class:`flags.SettingError` naming the first bad field(s) (the flags, when built by
        ``flags.from_args``)."""
        for field in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "make_vocab_size_divisible_by"):
            value = getattr(self, field)
            if value < 1:
                raise SettingError(field, "{" + field + "}" + f"={value} must be >= 1")
        for field, allowed in (("transformer_impl", TRANSFORMER_IMPLS), ("loss_head", LOSS_HEADS),
                               ("sdpa_backend", SDPA_BACKENDS)):
            value = getattr(self, field)
            if value not in allowed:
                raise SettingError(field, "{" + field + "}" + f"={value!r}: expected one of {', '.join(allowed)}")
        for field, (only, why) in _ONLY.items():
            value = getattr(self, field)
            if value != only:
                raise SettingError(field, "{" + field + "}" + f"={value}: only {only} is supported ({why})")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise SettingError("attention_backend",
                               f"{{attention_backend}}={self.attention_backend!r}: expected one of "
                               f"{', '.join(ATTENTION_BACKENDS)} (the local layers run torch's SDPA kernels)")
        if self.attention_backend != "auto" and self.sdpa_backend not in ("auto", ATTENTION_BACKENDS[self.attention_backend]):
            raise SettingError(("attention_backend", "sdpa_backend"),
                               f"{{attention_backend}} {self.attention_backend} and {{sdpa_backend}} "
                               f"{self.sdpa_backend} disagree: give one of them")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise SettingError(("sequence_parallel", "tensor_model_parallel_size"),
                               "{sequence_parallel} needs {tensor_model_parallel_size} > 1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the Megatron backend's flags to ``parser``: ``MegatronSettings``' fields declare them,
    plus two of slime's that set nothing here."""
    add_flags(parser, MegatronSettings)
    g = section(parser, "megatron backend")
    g.add_argument("--attention-softmax-in-fp32", action="store_true", default=True,
                   help="always so here: both backends take the attention softmax in float32")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true", default=True,
                   help="always so here: gradients are accumulated and reduced in float32 (both backends)")


def settings_from_args(args: argparse.Namespace) -> MegatronSettings:
    """Build :class:`MegatronSettings` from parsed flags (``ValueError`` naming bad flags)."""
    return from_args(MegatronSettings, args)
