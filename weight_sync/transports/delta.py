"""``--update-weight-mode delta`` over the ``distributed`` and ``disk`` transports: the same
transports, with each bucket sent as its delta against the last push when that push's copy is
what every engine holds (``weight_sync/delta.py`` decides and encodes;
``sglang_protocol/delta_weights.py`` is the wire form and the engines' apply).

- distributed: a delta bucket is one ``uint8`` tensor broadcast like any bucket; its header rides
  in the request's ``names`` (SGLang hands it to the model's ``load_weights``, which
  ``delta_weights.install`` wraps; the embedded engine applies it to its parameters).
- disk: a delta version is ``<disk_dir>/weights_v<version>/`` holding ``model.safetensors`` with
  one ``uint8`` tensor per bucket, named by its header, and the marker file ``delta_weights.DELTA_MARKER``.

A full push in delta mode first arms SGLang engines (``arm_sglang``) and records the copy. A
failed push or a resync makes the next push full.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import torch

from sglang_protocol.buckets import flatten_bucket, parse_dtype
from sglang_protocol.delta_weights import DELTA_FILE, DELTA_MARKER
from weight_sync import disk
from weight_sync.delta import DeltaTracker, arm_sglang
from weight_sync.engines import EngineState, begin_session, call_all, end_session
from weight_sync.interfaces import WeightSyncSettings
from weight_sync.link import Link, fill_cast
from weight_sync.plan import Bucket
from weight_sync.transports.base import Mark, Payload, Progress, Resume, start_packing
from weight_sync.transports.disk import DiskTransport, PostWrite
from weight_sync.transports.distributed import DistributedTransport



class DeltaDistributedTransport(DistributedTransport):
    """The weight-update group of ``distributed``; buckets as deltas where possible."""

    def __init__(self, settings: WeightSyncSettings, mark: Mark):
        super().__init__(settings, mark)
        self.tracker = DeltaTracker(self.settings)
        self._resync = False
        self._ready: dict[int, list[torch.Tensor]] = {}  # delta buckets encoded by prepare()

    async def prepare(self, members: list[EngineState], payload: Payload, keep: bool = True) -> float:
        """Choose full or delta; a delta push is encoded whole here, before the engines pause (the
        encoded buckets are small; encoding, not sending, is most of a delta push's work)."""
        self._resync, self._ready = not keep, {}
        if keep:
            await self.tracker.choose(members, payload.buckets)
        else:  # a resync sends that engine its tensors in full; the others' copy may differ from them
            self.tracker.invalidate("an engine was resynced")
            self.tracker.delta = False
        try:
            connect_s = await super().prepare(members, payload, keep)
            if self.tracker.delta:
                link = self._active
                for i in range(1, len(payload.buckets)):
                    self._ready[i] = await self._pack(link, payload, i)
        except BaseException:  # the copy may be half brought to the new values
            self.tracker.invalidate("encoding the last push failed")
            raise
        return connect_s

    async def send(self, members: list[EngineState], payload: Payload, version: int, progress: Progress | None,
                   resume: Resume | None) -> float:
        try:
            if not self.tracker.delta:
                await arm_sglang(members, self.settings)
            t = await super().send(members, payload, version, progress, resume)
        except BaseException:  # the engines may hold part of it: the next push is full
            self.tracker.invalidate("the last push failed")
            raise
        if not self._resync:
            self.tracker.commit(version)
        return t

    async def finish(self) -> None:
        self._ready = {}
        await super().finish()

    async def after_failure(self, members: list[EngineState], alive: set[str]) -> None:
        self.tracker.invalidate("the last push failed")
        await super().after_failure(members, alive)

    def metrics(self) -> dict[str, float]:
        return self.tracker.metrics()

    def _wire(self, buckets: list[Bucket], i: int) -> Bucket:
        return self.tracker.wire.get(i, buckets[i]) if self.tracker.delta else buckets[i]

    def _pack(self, link: Link, payload: Payload, i: int) -> "asyncio.Future[list[torch.Tensor]]":
        if i in self._ready:  # encoded before the pause
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(self._ready.pop(i))
            return fut
        tracker, bucket, resync = self.tracker, payload.buckets[i], self._resync

        def pack() -> list[torch.Tensor]:
            out = link.pack(payload.named, bucket, link.device)
            if resync:
                return out
            flat = out[0] if link.flattened else flatten_bucket(out)
            sent = tracker.encode(i, bucket, flat)
            return [sent] if (tracker.delta or link.flattened) else out
        # encoding waits for the GPU and deflates on the CPU: never on the loop (a full pack only queues copies)
        return start_packing(pack, here=link.device.type == "cuda" and not tracker.delta)


class DeltaDiskTransport(DiskTransport):
    """The disk transport; a version goes as a delta directory where possible."""

    def __init__(self, settings: WeightSyncSettings, mark: Mark, post_write: PostWrite | None = None):
        super().__init__(settings, mark, post_write)
        self.tracker = DeltaTracker(self.settings)
        self._resync = False
        self._encoded: dict[str, torch.Tensor] | None = None  # by prepare(): header -> delta payload

    async def prepare(self, members: list[EngineState], payload: Payload, keep: bool = True) -> float:
        """Choose full or delta, and encode every bucket (the copy updated) before the engines pause."""
        self._resync, self._encoded = not keep, None
        if keep:
            await self.tracker.choose(members, payload.buckets)
            try:
                self._encoded = await asyncio.get_running_loop().run_in_executor(None, self._encode_all, payload)
            except BaseException:  # the copy may be half brought to the new values
                self.tracker.invalidate("encoding the last push failed")
                raise
        else:
            self.tracker.invalidate("an engine was resynced")
            self.tracker.delta = False
        return 0.0

    async def send(self, members: list[EngineState], payload: Payload, version: int, progress: Progress | None,
                   resume: Resume | None) -> float:
        if self._resync:
            return await super().send(members, payload, version, progress, resume)
        try:
            return await self._send(members, payload, version, progress, resume)
        except BaseException:  # the engines may hold part of it: the next push is full
            self.tracker.invalidate("the last push failed")
            raise

    async def _send(self, members: list[EngineState], payload: Payload, version: int, progress: Progress | None,
                    resume: Resume | None) -> float:
        s, tr = self.settings, self.tracker
        loop = asyncio.get_running_loop()
        sglang = [e for e in members if not e.complete]
        if not tr.delta and sglang:
            await begin_session(sglang, s.timeout_s)  # SGLang takes the arming request only inside one
            await arm_sglang(sglang, s)
            await end_session(sglang, s.timeout_s)
        encoded, self._encoded = self._encoded, None
        if not tr.delta:  # the engines load the full checkpoint; the copy was recorded while encoding
            t = await super().send(members, payload, version, progress, resume)
            tr.commit(version)
            return t
        path = await loop.run_in_executor(None, self._write_delta, encoded, version)
        await self._post_write(path, members, version)
        t = time.perf_counter()
        await call_all(members, lambda c: c.update_weights_from_disk(str(path), str(version), timeout=s.timeout_s),
                       "update_weights_from_disk")
        tr.commit(version)
        return time.perf_counter() - t

    async def after_failure(self, members: list[EngineState], alive: set[str]) -> None:
        self.tracker.invalidate("the last push failed")

    def metrics(self) -> dict[str, float]:
        return self.tracker.metrics()

    def _encode_all(self, payload: Payload) -> dict[str, torch.Tensor]:
        """Each bucket packed in the engines' dtype and encoded (the copy updated); header -> payload."""
        out = {}
        for i, b in enumerate(payload.buckets):
            dtype = parse_dtype(b.dtype)
            flat = torch.empty(b.nbytes, dtype=torch.uint8)  # [bytes]
            with torch.no_grad():
                fill_cast(flat, [payload.named[j][1].detach() for j in b.indices], dtype)
            sent = self.tracker.encode(i, b, flat)
            if self.tracker.delta:
                out[self.tracker.wire[i].specs[0].name] = sent.cpu()
        return out

    def _write_delta(self, encoded: dict[str, torch.Tensor], version: int):
        from safetensors.torch import save_file

        final = disk.checkpoint_dir(self.settings.disk_dir, version)
        tmp = final.with_name(final.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        save_file(encoded, str(tmp / DELTA_FILE), metadata={"format": "pt"})
        (tmp / DELTA_MARKER).write_text(json.dumps({"base": str(self.tracker.base_version)}))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        disk.prune_checkpoints(self.settings.disk_dir, self.settings.disk_keep)
        return final
