"""Transport ``tensor`` (colocated mode: trainer and engines on the same GPUs): no process group;
per bucket one POST ``/update_weights_from_tensor`` per engine carrying, for each of its TP ranks,
a serialised handle to the bucket (CUDA IPC on GPUs: the engine maps the trainer's memory and
copies from it, nothing goes through the host; a shared-memory file on the CPU).

A bucket is kept flattened (one handle per bucket, ``load_format`` ``flattened_bucket``) and alive
until every engine has answered it (an engine answers once it has copied it); bucket k+1 is packed
while bucket k's requests are in flight.

With ``load_format`` ``mapped``, the trainer's parameters (``torch.nn.Parameter``: storage that
stays put, updated in place by the optimizer) go first, as handles to themselves in one request
whose ``load_format`` is ``sglang_protocol.held_weights.LOADER`` (SGLang's ``--custom-weight-loader``):
each engine loads them and holds them, so from the second push on it opens no handle, and the
engine casts while it copies (no staging copy on the trainer). Other tensors (gathered or
converted ones, fresh at every push) travel in flattened buckets as above; the last request
carries the version. ``release`` (at close) lets the engines drop what they hold. Engines must
allow the loader (``--custom-weight-loader``); with ``load_format`` ``auto`` a refusal falls back
to flattened buckets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Awaitable, Callable

import torch

from sglang_protocol import held_weights, tensor_update
from weight_sync.engines import EngineState
from weight_sync.interfaces import Named, TensorSpec, WeightSyncSettings
from weight_sync.link import TensorChannel, send_tensor_bucket
from weight_sync.plan import plan_buckets
from weight_sync.transports.base import (Mark, Payload, Progress, Resume, Transport, last_bucket, send_buckets,
                                         start_packing)

logger = logging.getLogger(__name__)
Packed = tuple[Any, list[torch.Tensor]]  # TensorChannel.pack's (what each rank deserialises, what it points into)


class TensorTransport(Transport):
    """Handles to the trainer's buckets (and, ``mapped``, to its parameters)."""

    def __init__(self, settings: WeightSyncSettings, mark: Mark, auto_format: bool = False):
        super().__init__(settings, mark)
        self._auto_format = auto_format  # load_format was auto: mapped, unless an engine does not allow it
        self._channel = TensorChannel(settings.load_format == "flattened_bucket")
        self._staged: "list[asyncio.Future[Packed]]" = []  # [bucket 0], packed by prepare()

    async def connect(self, engines: list[EngineState]) -> None:
        if self.settings.load_format != "mapped":
            return
        refused = await asyncio.gather(*(_check_loader_allowed(e) for e in engines), return_exceptions=True)
        refused = [r for r in refused if isinstance(r, BaseException)]
        if refused and not self._auto_format:
            raise refused[0]
        if refused:  # auto: the format every engine takes
            logger.warning("weight sync: flattened buckets, not mapped: %s", refused[0])
            self.settings.load_format = "flattened_bucket"  # the sender's own copy of the settings

    def plan(self, named: Named, sent: list[TensorSpec]) -> Payload:
        """``mapped``: the parameters go as held handles, the other tensors in buckets."""
        held = [i for i, (_, t) in enumerate(named)
                if self.holds_weights and isinstance(t, torch.nn.Parameter) and t.is_contiguous()]
        if not held:
            return super().plan(named, sent)
        rest = sorted(set(range(len(named))) - set(held))
        buckets = plan_buckets([sent[i] for i in rest], self.settings.bucket_bytes)
        return Payload(named, [dataclasses.replace(b, indices=[rest[j] for j in b.indices]) for b in buckets], held)

    async def prepare(self, members: list[EngineState], payload: Payload, keep: bool = True) -> float:
        self._channel.flattened = self.settings.load_format != "tensor"
        self._staged = [self._pack(payload, 0)] if payload.buckets else []
        if self._staged:
            await self._staged[0]
        return 0.0

    async def send(self, members: list[EngineState], payload: Payload, version: int, progress: Progress | None,
                   resume: Resume | None) -> float:
        """Send the held tensors (``mapped``), then every bucket (bucket 0 staged by ``prepare``);
        return the seconds spent sending. Bucket k is let go once every engine has answered it (each
        has copied it by then)."""
        s = self.settings
        named, buckets = payload.named, payload.buckets
        peers = [(e.url, e.gpus, e.client) for e in members]
        t = time.perf_counter()
        if payload.held:
            pairs = held_weights.pack([(named[i][0], named[i][1].detach()) for i in payload.held])
            if pairs[0][1].is_cuda:  # an engine that finds these storages mapped already waits for no
                torch.cuda.synchronize(pairs[0][1].device)  # event of ours: the trainer's writes end first
            await send_tensor_bucket(held_weights.LOADER, peers, pairs, s, **last_bucket(s, version, not buckets))
            self.mark("held", -1)
        if not buckets:
            return time.perf_counter() - t
        fmt = tensor_update.FLATTENED if self._channel.flattened else None

        def send_one(i: int, packed: Packed, after: Callable[[], None] | None) -> Awaitable[None]:
            return send_tensor_bucket(fmt, peers, packed[0], s, **last_bucket(s, version, i == len(buckets) - 1),
                                      after_issue=after)
        await send_buckets(len(buckets), lambda i: self._pack(payload, i), send_one, self._staged, progress, self.mark)
        return time.perf_counter() - t

    async def finish(self) -> None:
        self._staged = []

    @property
    def holds_weights(self) -> bool:
        return self.settings.load_format == "mapped"

    async def release(self, members: list[EngineState]) -> None:
        """An empty list to the loader: the engines drop the trainer's tensors they hold."""
        peers = [(e.url, e.gpus, e.client) for e in members]
        await send_tensor_bucket(held_weights.LOADER, peers, [], self.settings, None, flush_cache=False)

    def _pack(self, payload: Payload, i: int) -> "asyncio.Future[Packed]":
        bucket = payload.buckets[i]
        return start_packing(lambda: self._channel.pack(payload.named, bucket),
                             here=payload.named[bucket.indices[0]][1].is_cuda)


async def _check_loader_allowed(e: EngineState) -> None:
    """ValueError naming the flags unless engine ``e`` lists the held-weights loader in its
    ``--custom-weight-loader`` (``/server_info``, SGLang's ``/get_server_info``)."""
    try:
        info = await e.client.server_info()
    except Exception as err:
        raise RuntimeError(f"engine {e.url}: cannot read /server_info to check --custom-weight-loader: {err}") from err
    if held_weights.LOADER not in (info.get("custom_weight_loader") or ()):
        raise ValueError(f"--update-weight-load-format mapped: engine {e.url} does not allow the loader "
                         f"{held_weights.LOADER} (start it with --custom-weight-loader {held_weights.LOADER}, as the "
                         f"engines a run starts are; or use --update-weight-load-format flattened_bucket)")
