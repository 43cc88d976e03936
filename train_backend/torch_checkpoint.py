"""Checkpoints of the torch backend.

``save(path)`` writes ``path/dcp/`` (model + optimizer through ``torch.distributed.checkpoint``:
each rank writes its own shards under FSDP2, and a checkpoint loads onto another number of ranks),
``path/trainer_state.pt`` (scheduler, optimizer-step counter) and ``path/rng_<rank>.pt``; with
PPO's critic (``--advantage-estimator ppo``), its model and optimizer in ``path/critic_dcp/`` and
its scheduler in ``trainer_state.pt``.
``export_hf(path)`` writes a plain HF checkpoint (``save_pretrained`` + tokenizer).
With LoRA (``--lora-rank``) the DCP checkpoint holds the adapter and its optimizer state only (the
frozen base is ``--hf-checkpoint``'s), ``save`` also writes the adapter in peft's format to
``path/adapter/``, and ``export_hf`` writes the adapter in peft's format (``adapter_config.json``,
``adapter_model.safetensors``): load it with peft on top of the base, or with SGLang's ``--lora-paths``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

if TYPE_CHECKING:
    from train_backend.torch_backend import TorchBackend

log = logging.getLogger(__name__)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def _single_process_ok(backend: "TorchBackend"):
    """DCP warns on every single-process save/load; that is the intended mode here."""
    with warnings.catch_warnings():
        if not backend.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _barrier(backend: "TorchBackend") -> None:
    if backend.distributed:
        dist.barrier()


def _options(model: torch.nn.Module) -> StateDictOptions:
    """Frozen parameters (a LoRA model's base) stay out of checkpoints: they are ``--hf-checkpoint``'s."""
    return StateDictOptions(ignore_frozen_params=any(not p.requires_grad for p in model.parameters()))


def _save_dcp(backend: "TorchBackend", model: torch.nn.Module, optimizer: Any, checkpoint_id: str) -> None:
    """A model and its optimizer (sharded under FSDP2) as one DCP checkpoint at ``checkpoint_id``."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    with _single_process_ok(backend):
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint_id, no_dist=not backend.distributed)


def _load_dcp(backend: "TorchBackend", model: torch.nn.Module, optimizer: Any, checkpoint_id: str) -> None:
    """Load what :func:`_save_dcp` wrote into ``model`` and ``optimizer``, in place."""
    options = _options(model)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    with _single_process_ok(backend):
        dcp.load(state, checkpoint_id=checkpoint_id, no_dist=not backend.distributed)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=options.ignore_frozen_params, strict=False))


def save(backend: "TorchBackend", path: str) -> None:
    """Save model, optimizer, scheduler, step counter and RNG state to directory ``path``."""
    os.makedirs(path, exist_ok=True)
    _save_dcp(backend, backend.model, backend.optimizer, os.path.join(path, "dcp"))
    if backend.critic is not None:
        _save_dcp(backend, backend.critic.model, backend.critic.optimizer, os.path.join(path, "critic_dcp"))
    if backend.rank == 0:
        torch.save(backend.extra_state(), os.path.join(path, "trainer_state.pt"))
    if backend.lora is not None:
        export_hf(backend, os.path.join(path, "adapter"))
    torch.save(_rng_state(), os.path.join(path, f"rng_{backend.rank}.pt"))
    _barrier(backend)


def load(backend: "TorchBackend", path: str) -> None:
    """Restore what :func:`save` wrote; ``RuntimeError`` if ``path`` is not such a checkpoint."""
    state_file = os.path.join(path, "trainer_state.pt")
    if not os.path.isdir(os.path.join(path, "dcp")) or not os.path.isfile(state_file):
        raise RuntimeError(f"{path} is not a torch-backend checkpoint (no dcp/ or trainer_state.pt)")
    _load_dcp(backend, backend.model, backend.optimizer, os.path.join(path, "dcp"))
    if backend.critic is not None:
        if not os.path.isdir(os.path.join(path, "critic_dcp")):
            raise RuntimeError(f"{path} holds no critic (critic_dcp/): it was not saved by an --advantage-estimator "
                               "ppo run")
        _load_dcp(backend, backend.critic.model, backend.critic.optimizer, os.path.join(path, "critic_dcp"))
    backend.load_extra_state(torch.load(state_file, weights_only=False))
    rng_file = os.path.join(path, f"rng_{backend.rank}.pt")
    if os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        log.warning("%s: no RNG state for rank %d (saved with fewer ranks); RNG not restored", path, backend.rank)
    _barrier(backend)


def export_hf(backend: "TorchBackend", path: str) -> None:
    """Write an HF checkpoint of the current weights (gathered to rank 0) and the tokenizer; with
    LoRA, the adapter in peft's format (``sglang_protocol.lora_adapter.write_adapter``)."""
    from transformers import AutoTokenizer

    if backend.lora is not None:
        from sglang_protocol.lora_adapter import write_adapter

        config, tensors = backend.adapter()
        if backend.rank == 0:
            write_adapter(path, config, tensors)
        _barrier(backend)
        return

    sd = get_model_state_dict(backend.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if backend.rank == 0:
        sd = {k: v.to(backend.compute_dtype) for k, v in sd.items()}  # the float32 masters in the compute dtype
        os.makedirs(path, exist_ok=True)
        backend.model.save_pretrained(path, state_dict=sd, safe_serialization=True)
        config = copy.deepcopy(backend.model.config)  # save_pretrained records the (float32) master dtype
        config.dtype = backend.settings.dtype
        config.save_pretrained(path)
        try:
            tok = AutoTokenizer.from_pretrained(backend.settings.hf_checkpoint)
        except (OSError, ValueError) as e:  # a checkpoint without tokenizer files: weights are still usable
            log.warning("export_hf: no tokenizer copied from %s: %s", backend.settings.hf_checkpoint, e)
        else:
            tok.save_pretrained(path)
    _barrier(backend)
