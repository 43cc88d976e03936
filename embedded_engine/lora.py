"""LoRA adapters on the embedded engine: SGLang's ``--enable-lora`` routes, served by merging.

SGLang's contract (0.5.23, ``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``):
``/load_lora_adapter`` ``{lora_name, lora_path}`` loads a peft directory; ``/load_lora_adapter_from_tensors``
``{lora_name, config_dict, serialized_named_tensors}``; ``/unload_lora_adapter`` ``{lora_name}``;
each answers ``{success, error_message, loaded_adapters}`` (400 when not successful); loading a
name that is loaded already fails; a ``/generate`` names its adapter with ``lora_path`` = its
``lora_name`` (absent: the base model).

How it is served here: the simplest correct way, not SGLang's batched LoRA kernels. Each adapter
is kept as loaded (``A``, ``B``); the model's weights hold the base plus at most one adapter's
merged deltas ``scaling * B @ A`` at a time (merged when a request first runs with it, so a load is
only the read), and the scheduler admits together only requests
of the adapter merged in (it switches, via :meth:`LoraAdapters.switch`, only when no request is
running), so every request sees the base plus its own adapter for its whole life. The base values
of the weights an adapter changes are kept to switch back exactly.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING, Any

import torch

from sglang_protocol.buckets import tensor_checksum
from sglang_protocol.lora_adapter import merged_deltas, module_pairs, module_suffixes, read_adapter

if TYPE_CHECKING:
    from .scheduler import Scheduler

log = logging.getLogger(__name__)


class LoraError(ValueError):
    """A refused LoRA call (answered 400 with its message)."""


class LoraAdapters:
    """The loaded adapters of one engine and which one the model's weights hold now."""

    def __init__(self, params: dict[str, torch.Tensor], scheduler: "Scheduler", enabled: bool, max_rank: int | None,
                 target_modules: list[str] | None) -> None:
        self.enabled, self.max_rank, self.target_modules = enabled, max_rank, target_modules
        self._params = params
        self._scheduler = scheduler
        self._uids = itertools.count(1)
        # lora_name -> (uid, config, the adapter's tensors as loaded)
        self._adapters: dict[str, tuple[int, dict, dict[str, torch.Tensor]]] = {}
        self._paths: dict[str, str] = {}  # lora_name -> where it was loaded from (SGLang's loaded_adapters)
        self._by_uid: dict[int, tuple[dict, dict[str, torch.Tensor]]] = {}
        self._base: dict[str, torch.Tensor] = {}  # base values of the weights the merged adapter changed
        self.merged: int | None = None  # uid of the adapter in the weights (scheduler thread)
        if enabled:
            scheduler.lora_switch = self.switch

    # --- the routes (event loop) ---------------------------------------------------------------
    def loaded(self) -> dict[str, str]:
        """SGLang's ``loaded_adapters``: ``{lora_name: lora_path}``."""
        return {name: self._paths.get(name, "__tensor__") for name in self._adapters}

    def resolve(self, lora_path: str | None) -> int | None:
        """The uid a ``/generate`` naming ``lora_path`` runs with (None: the base); LoraError if not loaded."""
        if lora_path is None:
            return None
        if not self.enabled:
            raise LoraError("lora_path: LoRA is not enabled on this engine (start it with --enable-lora)")
        entry = self._adapters.get(lora_path)
        if entry is None:
            raise LoraError(f"lora_path: the LoRA adapter {lora_path!r} is not loaded (loaded: "
                            f"{sorted(self._adapters)})")
        return entry[0]

    async def load_from_path(self, name: str, path: str) -> None:
        if name in self._adapters:  # before reading the files, as SGLang's registry answers first
            raise LoraError(f"lora_name: the LoRA adapter {name!r} is already loaded (unload it first)")
        config, tensors = await asyncio.get_running_loop().run_in_executor(None, read_adapter, path)
        await self.load(name, config, tensors)
        self._paths[name] = path

    async def load(self, name: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Check the adapter against the model and the engine's limits, then register it."""
        if not self.enabled:
            raise LoraError("LoRA is not enabled on this engine (start it with --enable-lora)")
        if not name:
            raise LoraError("lora_name: must not be empty")
        if name in self._adapters:
            raise LoraError(f"lora_name: the LoRA adapter {name!r} is already loaded (unload it first)")
        try:
            rank = int(config["r"])
            pairs = module_pairs(tensors)
        except (KeyError, TypeError, ValueError) as e:
            raise LoraError(f"config: not a peft LoRA adapter: {e}") from e
        if self.max_rank is not None and rank > self.max_rank:
            raise LoraError(f"r: the adapter's rank {rank} exceeds --max-lora-rank {self.max_rank}")
        for module, (a, b) in pairs.items():
            weight = f"{module}.weight"
            p = self._params.get(weight)
            if p is None:
                raise LoraError(f"{module}: no such module in the model")
            if self.target_modules is not None and module.rsplit(".", 1)[-1] not in self.target_modules:
                raise LoraError(f"{module}: not one of --lora-target-modules {self.target_modules}")
            if a.shape != (rank, p.shape[1]) or b.shape != (p.shape[0], rank):
                raise LoraError(f"{module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the weight "
                                f"{list(p.shape)} at rank {rank}")
        uid = next(self._uids)
        held = {k: v.clone() for k, v in tensors.items()}
        self._adapters[name] = (uid, config, held)
        self._by_uid[uid] = (config, held)  # merged when a request first runs with it (switch)

    def unload(self, name: str) -> None:
        """Forget ``name``; requests still running with it finish on the weights they started with."""
        if name not in self._adapters:
            raise LoraError(f"lora_name: the LoRA adapter {name!r} is not loaded")
        uid = self._adapters.pop(name)[0]
        self._paths.pop(name, None)
        self._by_uid.pop(uid, None)

    async def checksums(self, name: str) -> dict[str, str]:
        """``{peft tensor name: sha256}`` of the adapter as this engine holds it (the read-back that
        ``--check-weight-update-equal`` compares with the trainer's)."""
        entry = self._adapters.get(name)
        if entry is None:
            raise LoraError(f"lora_name: the LoRA adapter {name!r} is not loaded")
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: {k: tensor_checksum(v) for k, v in entry[2].items()})

    async def restore_base(self) -> None:
        """Put the base weights back (before a full weight update writes new base values)."""
        def unmerge() -> None:
            self.switch(None)
            self._scheduler.lora_merged = None
        await asyncio.wrap_future(self._scheduler.run_command(unmerge))

    # --- the scheduler thread --------------------------------------------------------------------
    def switch(self, uid: int | None) -> None:
        """Make the weights hold the base plus adapter ``uid`` (None: the base alone). Called by the
        scheduler between forwards with no request running; LoraError if ``uid`` was unloaded."""
        adapter = self._by_uid.get(uid) if uid is not None else None
        if uid is not None and adapter is None:
            raise LoraError(f"the LoRA adapter of this request was unloaded (uid {uid})")
        with torch.no_grad():
            for name, base in self._base.items():
                self._params[name].copy_(base)
            self._base = {}
            if adapter is not None:
                config, tensors = adapter
                for module, pair in module_pairs(tensors).items():  # one weight's delta at a time
                    p = self._params[f"{module}.weight"]
                    self._base[f"{module}.weight"] = p.detach().clone()
                    delta = merged_deltas(config, {"a.lora_A.weight": pair[0], "a.lora_B.weight": pair[1]}, p.dtype)
                    p.add_(delta["a.weight"])
        self.merged = uid


def parse_target_modules(value: Any) -> list[str] | None:
    """``--lora-target-modules``' names (None: all, SGLang's ``all``)."""
    return module_suffixes(value or None)


def decode_tensors(serialized: Any, load_format: str | None = None,
                   expected_checksums: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """``serialized_named_tensors`` of ``/load_lora_adapter_from_tensors``: TP rank 0's entry, as
    SGLang's ``TpModelWorker.load_lora_adapter_from_tensors`` reads it: a ``{name: tensor}`` dict, or
    with ``load_format`` ``flattened_bucket`` a flattened bucket (``sglang_protocol.tensor_update``).
    ``expected_checksums`` (``{name: sha256 of the raw bytes}``): every tensor checked, none missing
    nor extra, as SGLang checks them."""
    import pickle

    from sglang_protocol.tensor_update import FLATTENED, deserialize, named_tensors

    if not isinstance(serialized, list) or not serialized:
        raise LoraError("serialized_named_tensors: expected a list with one payload per TP rank")
    try:
        obj = deserialize(serialized[0])
        if load_format == FLATTENED:
            pairs = named_tensors(obj, FLATTENED)
        elif isinstance(obj, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
            pairs = list(obj.items())
        else:
            raise ValueError("expected a {name: tensor} dict (or load_format flattened_bucket)")
    except (pickle.UnpicklingError, ValueError) as e:
        raise LoraError(f"serialized_named_tensors: {e}") from e
    tensors = {n: t.clone() for n, t in pairs}
    if expected_checksums is not None:
        got = {n: tensor_checksum(t) for n, t in tensors.items()}
        bad = sorted(n for n in set(got) | set(expected_checksums) if got.get(n) != expected_checksums.get(n))
        if bad:
            raise LoraError(f"expected_checksums: {len(bad)} adapter tensor(s) differ, are missing or extra, "
                            f"e.g. {bad[0]!r}")
    return tensors
