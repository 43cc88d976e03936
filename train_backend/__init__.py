"""Train backends (torch: HF + FSDP2; megatron: Megatron-core) and the RL losses they share.

    from train_backend import TrainSettings, create_backend
    backend = create_backend(TrainSettings(hf_checkpoint="examples/toy/model"))
    metrics = backend.train_step(groups, step=0)
"""

from train_backend.interfaces import TrainBackend, TrainSettings, create_backend

__all__ = ["TrainBackend", "TrainSettings", "create_backend"]
