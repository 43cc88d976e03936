"""Adapter-only weight sync: with LoRA (``--lora-rank``) a push sends the adapter, not the model.

A push of version v (:meth:`weight_sync.sender.WeightSender.push_adapter`):
1. write the adapter in peft's format (``sglang_protocol/lora_adapter.py``) to
   ``<dir>/v<version>/`` (``--update-weight-disk-dir``; the launcher defaults it to the run's
   ``lora_adapters/``), which the engines must be able to read (the embedded engines are allowed it;
   the ``tensor`` transport skips the file, below);
2. ``/pause_generation`` on every live engine (``--update-weight-pause-mode``);
3. SGLang's ``/unload_lora_adapter`` then ``/load_lora_adapter`` ``{lora_name, lora_path}`` under
   ``POLICY_ADAPTER``, the name the rollout's requests give as ``lora_path`` (SGLang refuses to load
   a name that is loaded, hence the unload; an engine that never had it answers 400, ignored);
4. ``/update_weight_version`` to v (adapter loads carry no version), so every sample generated
   afterwards reports v;
5. with ``--check-weight-update-equal``: the adapter each engine holds, read back
   (``/lora_adapter_checksum``, the embedded engine's), compared with the trainer's byte for byte
   (a load from tensors also carries SGLang's ``expected_checksums``, which the engine checks as it
   loads; SGLang 0.5.15 has none: the push stops before pausing, naming the flag);
6. ``/continue_generation``. Older versions' directories beyond ``--update-weight-disk-keep`` go.

With the ``tensor`` transport (colocated, ``--colocate``) step 1 writes no file: step 3 loads with
SGLang's ``/load_lora_adapter_from_tensors`` ``{lora_name, config_dict, serialized_named_tensors}``,
handles to a copy of the adapter (CUDA IPC on GPUs, shared memory on the CPU), one per TP rank
(SGLang before 0.5.17 takes one ``serialized_tensors`` instead, and checks no checksums before
0.5.16: the body follows the release each engine's ``/server_info`` reports,
``sglang_protocol/lora_adapter.py``).
The disk route is the one that also works across hosts. A failed attempt is redone without the
engines that stopped answering (``--update-weight-retries``); a dead engine that answers again gets
the adapter at the next push (a restarted one has none: the fleet keeps it out of the router until a
push brings it to the fleet's version). After the last failed attempt the live engines stay paused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time

import torch

from sglang_protocol.buckets import tensor_checksum
from sglang_protocol.client import EngineError
from sglang_protocol.lora_adapter import POLICY_ADAPTER, cuda_device_by_uuid, tensors_load_request, write_adapter
from weight_sync.engines import EngineState, call_all
from weight_sync.interfaces import WeightSyncSettings
from weight_sync.link import PushFailed

logger = logging.getLogger(__name__)


class AdapterPush:
    """Pushes the trainer's LoRA adapter to engines (the steps of the module docstring)."""

    def __init__(self, settings: WeightSyncSettings) -> None:
        self.settings = settings
        self._own_dir = settings.disk_dir is None
        self.dir = settings.disk_dir or tempfile.mkdtemp(prefix="reservoir-lora-")
        self._written: list[str] = []

    async def push(self, engines: list[EngineState], config: dict, tensors: dict[str, torch.Tensor],
                   version: int) -> dict[str, float]:
        """The module docstring's steps on every live engine (and every dead one that answers
        ``/health`` again: a restarted engine gets the adapter before the fleet lets it serve). A
        failed attempt marks the engines that stopped answering dead and is redone on the others,
        ``--update-weight-retries`` times."""
        last: PushFailed | None = None
        for attempt in range(self.settings.retries + 1):
            await self._revive(engines)
            members = [e for e in engines if e.alive]
            if not members:
                raise RuntimeError(f"push_adapter v{version}: no live engine") from last
            try:
                metrics = await self._push(members, config, tensors, version)
            except PushFailed as err:
                last = err
                logger.warning("push_adapter v%d attempt %d failed: %s", version, attempt + 1, err)
                healthy = await asyncio.gather(*(e.client.health(timeout=min(5.0, self.settings.timeout_s))
                                                 for e in members))
                for e, ok in zip(members, healthy):
                    if e.url in err.failed:
                        e.errors.append(err.failed[e.url])
                    if not ok:
                        e.alive, e.version = False, None
                continue
            metrics["weight_sync/attempts"] = float(attempt + 1)
            return metrics
        raise RuntimeError(f"push_adapter v{version}: failed after {self.settings.retries + 1} attempts; live "
                           "engines are left paused") from last

    async def _revive(self, engines: list[EngineState]) -> None:
        dead = [e for e in engines if not e.alive]
        healthy = await asyncio.gather(*(e.client.health(timeout=min(2.0, self.settings.timeout_s)) for e in dead))
        for e, ok in zip(dead, healthy):
            if ok:
                logger.info("engine %s answers again; it gets the adapter with this push", e.url)
                e.alive = True

    async def _push(self, members: list[EngineState], config: dict, tensors: dict[str, torch.Tensor],
                    version: int) -> dict[str, float]:
        s = self.settings
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        by_tensors = s.resolved_transport() == "tensor"  # colocated: handles to copies, no file
        if by_tensors:
            from sglang_protocol.tensor_update import serialize

            # the body differs between SGLang releases (sglang_protocol/lora_adapter.py): ask each engine's
            releases = await call_all(members, lambda c: c.sglang_release(), "server_info")
            copies = {n: t.detach().clone() for n, t in tensors.items()}  # alive until every engine copied them
            nbytes = sum(t.numel() * t.element_size() for t in copies.values())
            blobs = {}  # SGLang reads a {name: tensor} dict; CUDA devices by UUID where the release can read it
            for by_uuid in {cuda_device_by_uuid(r) for r in releases}:
                blobs[by_uuid] = await loop.run_in_executor(None, serialize, copies, by_uuid)
            # SGLang 0.5.16+ (and the embedded engine) verify every tensor as they load it
            sums = await loop.run_in_executor(None, _checksums, tensors) if s.check_equal else None
            try:
                requests = {e.url: tensors_load_request(r, POLICY_ADAPTER, config, blobs[cuda_device_by_uuid(r)], e.gpus,
                                                        sums)
                            for e, r in zip(members, releases)}
            except ValueError as err:
                raise ValueError(f"--check-weight-update-equal with --lora-rank and the tensor transport: {err}; "
                                 "drop the flag or run SGLang 0.5.16+") from None
        else:
            path = os.path.abspath(os.path.join(self.dir, f"v{version}"))
            nbytes = await loop.run_in_executor(None, write_adapter, path, config, tensors)
            body = {"lora_name": POLICY_ADAPTER, "lora_path": path}

        async def load(e: EngineState) -> dict:
            if by_tensors:
                r = requests[e.url]
                return await e.client.request("POST", "/load_lora_adapter_from_tensors", r.body, timeout=s.timeout_s,
                                              admin=r.admin)
            return await e.client.request("POST", "/load_lora_adapter", body, timeout=s.timeout_s, admin=True)
        written = time.perf_counter()
        t_pause = time.perf_counter()
        await call_all(members, lambda c: c.pause_generation(s.pause_mode), "pause_generation")
        await call_all(members, _unload, "unload_lora_adapter")
        outs = await asyncio.gather(*(load(e) for e in members), return_exceptions=True)
        failed = {e.url: f"load_lora_adapter: {type(o).__name__}: {o}" for e, o in zip(members, outs)
                  if isinstance(o, BaseException)}
        if failed:
            raise PushFailed(failed)
        await call_all(members, lambda c: c.request("POST", "/update_weight_version", {
            "new_version": str(version), "abort_all_requests": False}, timeout=s.timeout_s, admin=True),
            "update_weight_version")
        loaded = time.perf_counter()
        # read back where the engine can (the embedded engine); SGLang verified a tensor load itself
        readable = [e for e in members if e.check != "readback"] if by_tensors else members
        check_s = await self._check(readable, tensors) if s.check_equal and readable else 0.0
        await call_all(members, lambda c: c.continue_generation(), "continue_generation")
        t1 = time.perf_counter()
        for e in members:
            e.version = version
        if not by_tensors:
            self._written.append(path)
        while len(self._written) > s.disk_keep:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)
        return {"weight_sync/time_s": t1 - t_pause, "weight_sync/transfer_s": loaded - t_pause,
                "weight_sync/write_s": written - t0, "weight_sync/check_s": check_s,
                "weight_sync/total_s": t1 - t0, "weight_sync/bytes": float(nbytes),
                "weight_sync/num_tensors": float(len(tensors)), "weight_sync/engines": float(len(members)),
                "weight_sync/version": float(version), "weight_sync/adapter": 1.0}

    async def _check(self, members: list[EngineState], tensors: dict[str, torch.Tensor]) -> float:
        """Each engine's adapter, read back as checksums, against the trainer's (RuntimeError naming
        the tensor and the engine)."""
        t = time.perf_counter()
        mine = await asyncio.get_running_loop().run_in_executor(None, _checksums, tensors)
        try:
            theirs = await call_all(members, lambda c: c.request("GET", f"/lora_adapter_checksum?lora_name="
                                                                  f"{POLICY_ADAPTER}", timeout=self.settings.timeout_s),
                                    "lora_adapter_checksum")
        except PushFailed as e:
            raise RuntimeError(f"check_weight_update_equal: cannot read the adapter back ({e}); --check-weight-update"
                               "-equal with --lora-rank needs engines serving /lora_adapter_checksum (the embedded "
                               "engine)") from e
        for e, sums in zip(members, theirs):
            for n, want in mine.items():
                if sums.get(n) != want:
                    raise RuntimeError(f"check_weight_update_equal: adapter tensor {n!r} differs on engine {e.url}: "
                                       f"engine {sums.get(n)!r} != trainer {want!r}")
        return time.perf_counter() - t

    def close(self) -> None:
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def _checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{name: sha256 of its raw bytes}``: what SGLang's ``expected_checksums`` and the embedded
    engine's ``/lora_adapter_checksum`` hold."""
    return {n: tensor_checksum(x.detach().cpu().contiguous()) for n, x in tensors.items()}


async def _unload(client) -> dict:
    """``/unload_lora_adapter`` of the policy's adapter; an engine that does not hold it is fine."""
    try:
        return await client.request("POST", "/unload_lora_adapter", {"lora_name": POLICY_ADAPTER}, admin=True)
    except EngineError as e:
        if e.status == 400 and "not loaded" in str(e) or e.status == 400 and "does not exist" in str(e):
            return {"success": True}
        raise
