"""torch.distributed + megatron-core parallel state initialisation (TP x PP x DP)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the default process group from the standard env vars (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) unless it already exists; gloo on CPU, nccl on CUDA."""
    if dist.is_initialized():
        return
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"torch.distributed is not initialised and ${var} is not set")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s))


def init_parallel_state(tp_size: int, pp_size: int, seed: int, device: torch.device) -> None:
    """Create megatron-core's TP/PP/DP groups and seed its RNG tracker.

    The world size must be a multiple of ``tp_size * pp_size``; the rest is data parallel.
    Call inside :func:`~train_backend.megatron.cpu_compat.cpu_mode` on CPU.
    """
    world = dist.get_world_size()
    if world % (tp_size * pp_size) != 0:
        raise ValueError(f"world size {world} is not a multiple of --tensor-model-parallel-size "
                         f"({tp_size}) x --pipeline-model-parallel-size ({pp_size})")
    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() != tp_size
                or parallel_state.get_pipeline_model_parallel_world_size() != pp_size):
            raise RuntimeError("megatron parallel state is already initialised with other sizes")
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy_parallel_state() -> None:
    """Tear down megatron's groups (the default process group stays)."""
    parallel_state.destroy_model_parallel()
