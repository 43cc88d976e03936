"""The train backend's contract: its settings, the protocol every backend implements, and the
factory that picks one.

Both backends (``torch``: an HF model with torch's optimizer and FSDP2; ``megatron``: Megatron-core)
take the same :class:`TrainSettings` and share the RL math in :mod:`train_backend.losses` and the
packing in :mod:`train_backend.batching`, so they train the same objective on the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TYPE_CHECKING, Iterator, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from buffer.sample import Sample

BACKENDS = ("torch", "megatron")
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gspo")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_LOSS_TYPES = ("k1", "k2", "k3")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
DTYPES = ("float32", "bfloat16")  # float16 would need loss scaling


@dataclass
class TrainSettings:
    """Everything a train backend needs. Field defaults are the flag defaults (one place).

    The flag of each field is ``--`` + the field name with ``-`` for ``_`` (slime's names), except
    ``backend`` (``--train-backend``), ``tis_cap`` (``--tis-clip``), ``lr_warmup_steps`` /
    ``lr_decay_steps`` (Megatron's ``--lr-warmup-iters`` / ``--lr-decay-iters``), ``device`` and
    ``dtype`` (``--train-device``, ``--train-dtype``).
    """

    hf_checkpoint: str
    backend: str = "torch"
    # optimizer and schedule (optimizer steps, not rollouts)
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    lr_decay_steps: int | None = None  # needed by linear/cosine: steps from 0 to reach min_lr
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # batching
    global_batch_size: int | None = None  # samples per optimizer step; None = the whole rollout batch
    max_tokens_per_micro_batch: int = 8192
    # advantages and policy loss
    advantage_estimator: str = "grpo"
    normalize_advantages: bool = False  # whiten advantages over all loss tokens of the rollout batch
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # None = eps_clip (symmetric); larger = DAPO's clip-higher
    eps_clip_c: float | None = None  # dual-clip constant (> 1) for negative advantages; None = off
    loss_agg: str = "token_mean"
    loss_agg_norm_length: int | None = None  # seq_mean_token_sum_norm divisor; None = longest response
    # KL to the reference model, entropy bonus
    use_kl_loss: bool = False
    kl_coef: float = 0.0
    kl_loss_type: str = "k3"
    entropy_coef: float = 0.0
    # truncated importance sampling against the engine's log-probs
    use_tis: bool = False
    tis_cap: float = 2.0
    # shared with the rollout side
    rollout_temperature: float = 1.0
    reward_key: str | None = None
    # placement
    device: str = "cpu"
    dtype: str = "float32"  # compute dtype; master weights and optimizer state stay float32
    seed: int = 0
    # HF export path pattern (``{rollout_id}`` is filled in); None = no export
    save_hf: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag of the first bad field."""
        def choice(flag: str, value: object, allowed: tuple[str, ...]) -> None:
            if value not in allowed:
                raise ValueError(f"{flag}={value!r}: expected one of {', '.join(allowed)}")

        choice("--train-backend", self.backend, BACKENDS)
        choice("--advantage-estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        choice("--loss-agg", self.loss_agg, LOSS_AGGREGATIONS)
        choice("--kl-loss-type", self.kl_loss_type, KL_LOSS_TYPES)
        choice("--lr-decay-style", self.lr_decay_style, LR_DECAY_STYLES)
        choice("--train-dtype", self.dtype, DTYPES)
        if not self.hf_checkpoint:
            raise ValueError("--hf-checkpoint is required by the train backend")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"--lr={self.lr}, --min-lr={self.min_lr}: need 0 <= min-lr <= lr and lr > 0")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"--lr-warmup-iters={self.lr_warmup_steps} must be >= 0")
        if self.lr_decay_style != "constant" and (self.lr_decay_steps is None or self.lr_decay_steps <= 0):
            raise ValueError(f"--lr-decay-style={self.lr_decay_style} needs --lr-decay-iters > 0")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad={self.clip_grad} must be >= 0 (0 = no clipping)")
        if self.global_batch_size is not None and self.global_batch_size <= 0:
            raise ValueError(f"--global-batch-size={self.global_batch_size} must be > 0")
        if self.max_tokens_per_micro_batch <= 0:
            raise ValueError(f"--max-tokens-per-micro-batch={self.max_tokens_per_micro_batch} must be > 0")
        if not 0 < self.eps_clip < 1:
            raise ValueError(f"--eps-clip={self.eps_clip} must be in (0, 1)")
        if self.eps_clip_high is not None and self.eps_clip_high <= 0:
            raise ValueError(f"--eps-clip-high={self.eps_clip_high} must be > 0")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1:
            raise ValueError(f"--eps-clip-c={self.eps_clip_c} must be > 1 (dual clip bounds -A * c)")
        if self.loss_agg_norm_length is not None and self.loss_agg_norm_length <= 0:
            raise ValueError(f"--loss-agg-norm-length={self.loss_agg_norm_length} must be > 0")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"--kl-coef={self.kl_coef}, --entropy-coef={self.entropy_coef} must be >= 0")
        if self.kl_coef > 0 and not self.use_kl_loss:
            raise ValueError(f"--kl-coef={self.kl_coef} has no effect without --use-kl-loss")
        if self.tis_cap <= 0:
            raise ValueError(f"--tis-clip={self.tis_cap} must be > 0")
        if self.rollout_temperature <= 0:
            raise ValueError(f"--rollout-temperature={self.rollout_temperature} must be > 0")

    @property
    def clip_high(self) -> float:
        """The upper clip range actually used (``eps_clip_high`` or, if unset, ``eps_clip``)."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


@runtime_checkable
class TrainBackend(Protocol):
    """What the launcher and weight_sync call on every trainer rank.

    Under data parallelism every rank calls each method in the same order (they are collective);
    ``train_step`` reads its batch from rank 0 (other ranks may pass ``None``) and gives each rank
    its share.
    """

    def train_step(self, groups: list[list[Sample]] | None, step: int) -> dict[str, float]:
        """Train on one rollout batch (groups of samples); returns ``train/...`` metrics."""
        ...

    def compute_log_probs(self, samples: list[Sample]) -> list[list[float]]:
        """Per-response-token log-probs of the current policy, engine-style (logits / temperature)."""
        ...

    def named_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) tensors under their HF names: what weight_sync broadcasts from rank 0."""
        ...

    def save(self, path: str) -> None:
        """Save model, optimizer, scheduler and RNG state to directory ``path``."""
        ...

    def load(self, path: str) -> None:
        """Restore what :meth:`save` wrote."""
        ...

    def export_hf(self, path: str) -> None:
        """Write an HF checkpoint (config, weights, tokenizer) that ``from_pretrained`` loads."""
        ...


def create_backend(settings: TrainSettings, megatron: Any = None) -> TrainBackend:
    """Build the backend named by ``settings.backend`` (Megatron is imported only when asked for).

    ``megatron``: the ``MegatronSettings`` (parallel layout) for the Megatron backend; None = defaults.
    """
    if settings.backend == "torch":
        from train_backend.torch_backend import TorchBackend

        return TorchBackend(settings)
    if settings.backend == "megatron":
        from train_backend.megatron import create_megatron_backend  # type: ignore[attr-defined]

        return create_megatron_backend(settings, megatron)
    raise ValueError(f"--train-backend={settings.backend!r}: expected one of {', '.join(BACKENDS)}")
