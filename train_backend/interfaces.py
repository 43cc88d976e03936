"""The train backend's contract: the protocol every backend implements and the factory that picks
one; the settings (``train_backend.settings``) are re-exported here.

Both backends (``torch``: an HF model with torch's optimizer and FSDP2; ``megatron``: Megatron-core)
take the same :class:`TrainSettings` and share the RL math in :mod:`train_backend.losses` and the
packing in :mod:`train_backend.batching`, so they train the same objective on the same batch.
"""

from __future__ import annotations

from typing import Any, TYPE_CHECKING, Iterator, Protocol, runtime_checkable

from train_backend.settings import BACKENDS, TrainSettings

if TYPE_CHECKING:
    import torch

    from buffer.sample import Sample


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
