"""Command-line flags of the Megatron backend (slime's / Megatron-LM's names) and their settings.

The launcher calls :func:`add_arguments` beside the torch half's ``train_backend/arguments.py``;
:func:`settings_from_args` builds and validates :class:`MegatronSettings`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

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


@dataclass
class MegatronSettings:
    """Parallel layout and Megatron-specific knobs. Field defaults are the flag defaults."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    make_vocab_size_divisible_by: int = 128
    recompute_activations: bool = False  # full recompute of every layer (saves activation memory)
    transformer_impl: str = "auto"  # auto = TransformerEngine if installed, else local + SDPA
    # Log-prob/entropy head: unfused = fp32 [N, V] copies + megatron's vocab-parallel cross
    # entropy; chunked = one memory-lean autograd function over token chunks; compiled = the same
    # with its chunk kernels through torch.compile (fused reductions; meant for CUDA).
    # auto = compiled on CUDA, chunked on the CPU (where compiling would only slow small runs).
    loss_head: str = "auto"
    # CUDA speed-ups that need neither TE nor apex; None = on with CUDA, off on the CPU.
    # Measured on an H200 (bench/train, 0.5B model, 4k tokens): MFU 0.31 -> 0.41 (compiled head)
    # -> 0.44 (+ SwiGLU fusion + compiled norms); peak memory 75 -> 35 GiB.
    bias_swiglu_fusion: bool | None = None  # megatron-core's torch.compile'd SwiGLU (fwd + bwd kernels)
    torch_compile: bool | None = None  # torch.compile the norm modules (see model.compile_norms)
    sdpa_backend: str = "auto"  # which SDPA kernel the local layers try first (auto = torch's choice)
    fused_adam: bool = False  # torch's fused AdamW kernel instead of its foreach implementation
    # slime's / Megatron-LM's flags (see _ONLY for the values that can be honoured)
    attention_backend: str = "auto"
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0

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
        """Raise ``ValueError`` naming the flag of the first bad field."""
        if self.tensor_model_parallel_size < 1:
            raise ValueError(f"--tensor-model-parallel-size={self.tensor_model_parallel_size} must be >= 1")
        if self.pipeline_model_parallel_size < 1:
            raise ValueError(f"--pipeline-model-parallel-size={self.pipeline_model_parallel_size} must be >= 1")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"--make-vocab-size-divisible-by={self.make_vocab_size_divisible_by} must be >= 1")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(f"--transformer-impl={self.transformer_impl!r}: expected one of "
                             f"{', '.join(TRANSFORMER_IMPLS)}")
        if self.loss_head not in LOSS_HEADS:
            raise ValueError(f"--loss-head={self.loss_head!r}: expected one of {', '.join(LOSS_HEADS)}")
        if self.sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"--sdpa-backend={self.sdpa_backend!r}: expected one of {', '.join(SDPA_BACKENDS)}")
        for name, (only, why) in _ONLY.items():
            if getattr(self, name) != only:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)}: only {only} is supported ({why})")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend={self.attention_backend!r}: expected one of "
                             f"{', '.join(ATTENTION_BACKENDS)} (the local layers run torch's SDPA kernels)")
        if self.attention_backend != "auto" and self.sdpa_backend not in ("auto", ATTENTION_BACKENDS[self.attention_backend]):
            raise ValueError(f"--attention-backend {self.attention_backend} and --sdpa-backend {self.sdpa_backend} "
                             "disagree: give one of them")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the Megatron backend's flags to ``parser``."""
    d = MegatronSettings
    g = parser.add_argument_group("megatron backend")
    g.add_argument("--tensor-model-parallel-size", type=int, default=d.tensor_model_parallel_size,
                   help="tensor-parallel ranks per model replica")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=d.pipeline_model_parallel_size,
                   help="pipeline stages per model replica")
    g.add_argument("--sequence-parallel", action="store_true", default=d.sequence_parallel,
                   help="shard activations along the sequence inside TP regions")
    g.add_argument("--use-distributed-optimizer", action="store_true", default=d.use_distributed_optimizer,
                   help="shard optimizer state and fp32 master weights over data-parallel ranks")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=d.make_vocab_size_divisible_by,
                   help="pad the vocabulary to a multiple of this x TP size")
    g.add_argument("--recompute-activations", action="store_true", default=d.recompute_activations,
                   help="recompute every layer's activations in backward (full, uniform, 1 layer)")
    g.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default=d.transformer_impl,
                   help="layer implementation: TransformerEngine or megatron-core local layers + SDPA")
    g.add_argument("--loss-head", choices=LOSS_HEADS, default=d.loss_head,
                   help="log-prob/entropy computation over the vocabulary: unfused (fp32 [N, V] copies), "
                        "chunked (memory-lean, recomputes the softmax in backward), compiled "
                        "(chunked with torch.compile'd kernels; for CUDA) or auto (compiled on CUDA)")
    g.add_argument("--bias-swiglu-fusion", action=argparse.BooleanOptionalAction, default=d.bias_swiglu_fusion,
                   help="megatron-core's fused (torch.compile'd) SwiGLU activation; no TE/apex needed "
                        "(default: on with CUDA)")
    g.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=d.torch_compile,
                   help="torch.compile the RMSNorm modules (fused kernels; the first step compiles; "
                        "default: on with CUDA)")
    g.add_argument("--sdpa-backend", choices=SDPA_BACKENDS, default=d.sdpa_backend,
                   help="local layers: the scaled_dot_product_attention kernel to try first "
                        "(auto = torch's default order)")
    g.add_argument("--fused-adam", action="store_true", default=d.fused_adam,
                   help="torch's fused AdamW kernel (without TE/apex megatron-core uses torch's foreach AdamW)")
    g.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS), default=d.attention_backend,
                   help="Megatron's name for the attention kernel: flash / fused pick SDPA's flash / cuDNN kernel first")
    for name, (only, why) in _ONLY.items():
        g.add_argument("--" + name.replace("_", "-"), type=type(only), default=getattr(d, name),
                       help=f"slime's flag; only {only} ({why})")
    g.add_argument("--attention-softmax-in-fp32", action="store_true", default=True,
                   help="always so here: both backends take the attention softmax in float32")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true", default=True,
                   help="always so here: gradients are accumulated and reduced in float32 (both backends)")


def settings_from_args(args: argparse.Namespace) -> MegatronSettings:
    """Build :class:`MegatronSettings` from parsed flags (``ValueError`` naming bad flags)."""
    return MegatronSettings(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        use_distributed_optimizer=args.use_distributed_optimizer,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        recompute_activations=args.recompute_activations,
        transformer_impl=args.transformer_impl,
        loss_head=args.loss_head,
        bias_swiglu_fusion=args.bias_swiglu_fusion,
        torch_compile=args.torch_compile,
        sdpa_backend=args.sdpa_backend,
        fused_adam=args.fused_adam,
        attention_backend=args.attention_backend,
        **{name: getattr(args, name) for name in _ONLY},
    )
