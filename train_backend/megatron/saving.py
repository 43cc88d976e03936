"""Checkpoints of the Megatron backend: training state (save/load) and HF export.

``save(path)`` writes, per (TP, PP) position, ``model_tp{t}_pp{p}.pt`` (the stage's megatron
state dict) and ``optim_tp{t}_pp{p}.pt`` (optimizer state incl. fp32 master weights; under the
distributed optimizer each rank writes its own shard, ``optim_tp{t}_pp{p}_dp{d}.pt``),
``rng_{rank}.pt`` per rank and ``trainer_state.pt``. A checkpoint loads onto the same parallel
layout only (checked).
"""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from train_backend.megatron import checkpoint

if TYPE_CHECKING:
    from train_backend.megatron.backend import MegatronBackend


def _position() -> str:
    return (f"tp{parallel_state.get_tensor_model_parallel_rank()}"
            f"_pp{parallel_state.get_pipeline_model_parallel_rank()}")


def _layout(b: "MegatronBackend") -> dict[str, Any]:
    return {"tp": b.mcfg.tensor_model_parallel_size, "pp": b.mcfg.pipeline_model_parallel_size,
            "dp": b.dp_size, "distributed_optimizer": b.mcfg.use_distributed_optimizer,
            "dtype": b.settings.dtype}


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _barrier() -> None:
    if dist.get_world_size() > 1:
        dist.barrier()


def save(b: "MegatronBackend", path: str) -> None:
    """Save model, optimizer, step counter and RNG states to directory ``path`` (collective)."""
    os.makedirs(path, exist_ok=True)
    _barrier()
    pos = _position()
    if b.dp_rank == 0:
        torch.save(checkpoint.unwrap(b.model).state_dict(), os.path.join(path, f"model_{pos}.pt"))
        if not b.mcfg.use_distributed_optimizer:
            torch.save(b.optimizer.state_dict(), os.path.join(path, f"optim_{pos}.pt"))
    if b.mcfg.use_distributed_optimizer:
        # Each rank holds a shard of the fp32 master weights and Adam moments: save it as is
        # (megatron's gather-to-DP-rank-0 path does not carry torch Adam's per-param 'step').
        shards = [{"inner": opt.optimizer.state_dict(),
                   "main": [[p.detach().clone() for p in g["params"]] for g in opt.optimizer.param_groups]}
                  for opt in _inner_optimizers(b.optimizer)]
        torch.save(shards, os.path.join(path, f"optim_{pos}_dp{b.dp_rank}.pt"))
    torch.save(_rng_state(), os.path.join(path, f"rng_{dist.get_rank()}.pt"))
    if dist.get_rank() == 0:
        torch.save({"optimizer_steps": b.optimizer_steps, "layout": _layout(b)},
                   os.path.join(path, "trainer_state.pt"))
    _barrier()


@torch.no_grad()
def load(b: "MegatronBackend", path: str) -> None:
    """Restore what :func:`save` wrote; ``RuntimeError`` if it is not such a checkpoint or was
    written with another parallel layout."""
    state_file = os.path.join(path, "trainer_state.pt")
    if not os.path.isfile(state_file):
        raise RuntimeError(f"{path} is not a Megatron-backend checkpoint (no trainer_state.pt)")
    state = torch.load(state_file, weights_only=False)
    if state["layout"] != _layout(b):
        raise RuntimeError(f"{path} was saved with layout {state['layout']}, this job has {_layout(b)}")
    pos = _position()
    model_sd = torch.load(os.path.join(path, f"model_{pos}.pt"), map_location=b.device, weights_only=False)
    checkpoint.unwrap(b.model).load_state_dict(model_sd)
    if b.mcfg.use_distributed_optimizer:
        shards = torch.load(os.path.join(path, f"optim_{pos}_dp{b.dp_rank}.pt"), map_location=b.device,
                            weights_only=False)
        for opt, shard in zip(_inner_optimizers(b.optimizer), shards, strict=True):
            opt.optimizer.load_state_dict(shard["inner"])
            for g, saved in zip(opt.optimizer.param_groups, shard["main"], strict=True):
                for p, t in zip(g["params"], saved, strict=True):
                    p.copy_(t)
    else:
        optim_sd = torch.load(os.path.join(path, f"optim_{pos}.pt"), map_location=b.device, weights_only=False)
        b.optimizer.load_state_dict(optim_sd)
    b.optimizer_steps = int(state["optimizer_steps"])
    rng = torch.load(os.path.join(path, f"rng_{dist.get_rank()}.pt"), weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    _barrier()


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The DistributedOptimizer(s) inside megatron's ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def export_hf(b: "MegatronBackend", path: str) -> None:
    """HF checkpoint of the current weights: gathered to rank 0, written with huggingface_hub's
    (sharding) safetensors writer, plus the config and tokenizer of ``--hf-checkpoint``."""
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoTokenizer

    weights = {n: t.detach().to("cpu", copy=True) for n, t in checkpoint.iter_hf_weights(b.model, b.dims)}
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        save_torch_state_dict(weights, path)
        cfg = b.hf_config.__class__.from_dict(b.hf_config.to_dict())
        cfg.dtype = b.dtype
        cfg.save_pretrained(path)
        try:
            tok = AutoTokenizer.from_pretrained(b.settings.hf_checkpoint)
        except (OSError, ValueError) as e:  # the weights are still usable without a tokenizer
            import logging

            logging.getLogger(__name__).warning("export_hf: no tokenizer copied from %s: %s",
                                                b.settings.hf_checkpoint, e)
        else:
            tok.save_pretrained(path)
    _barrier()
