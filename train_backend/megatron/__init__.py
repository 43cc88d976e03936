"""The Megatron-core train backend (TP/PP/DP, bf16 on GPU, CPU via gloo).

Import cost matters (megatron-core is large), so the backend is imported lazily through
:func:`create_megatron_backend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from train_backend.settings import TrainSettings
    from train_backend.megatron.arguments import MegatronSettings
    from train_backend.megatron.backend import MegatronBackend


def create_megatron_backend(settings: "TrainSettings", megatron: "MegatronSettings | None" = None
                            ) -> "MegatronBackend":
    """Build the Megatron backend (every trainer rank calls this; collective)."""
    from train_backend.megatron.backend import MegatronBackend

    return MegatronBackend(settings, megatron)
