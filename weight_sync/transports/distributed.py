"""Transport ``distributed``: a weight-update group (NCCL on CUDA, gloo on CPU) of trainer rank 0
and the engines, and a broadcast per bucket (``weight_sync/link.py``).

The group is joined at connect over every engine and kept between pushes; a push over other
members (an engine died, or came back) rebuilds it first, and so does a push that finds an engine
restarted. Bucket 0 is packed before the engines pause. Per bucket, the sender POSTs
``/update_weights_from_distributed`` (names, dtypes, shapes) to every engine and, while those
requests are in flight, broadcasts the bucket from rank 0 (the engines receive inside their
handlers); the next bucket is packed while the current one travels. Over NCCL a broadcast is only
queued on the GPU: up to ``_MAX_INFLIGHT`` are in flight at once, and the engines are continued
as soon as the last bucket is answered, while rank 0 waits for its last transfers (an engine's
next forwards queue on its GPU behind the copies). A failed attempt aborts the group (NCCL's
graceful shutdown would wait for dead peers). A resync builds a group of the trainer and that
engine only, left once the session is closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from typing import Awaitable, Callable

import torch

from weight_sync.engines import EngineState
from weight_sync.interfaces import WeightSyncSettings
from weight_sync.plan import Bucket
from weight_sync.link import Link, abort_link, close_link, open_link, send_bucket, wait_transfer
from weight_sync.transports.base import (Mark, Payload, Progress, Resume, Transport, last_bucket, send_buckets,
                                         start_packing)

logger = logging.getLogger(__name__)
# Buckets queued on the GPU at once (nccl): enough to keep the link busy while the next bucket's
# HTTP round trip runs, few enough that in-flight copies stay a small multiple of bucket_bytes.
_MAX_INFLIGHT = 3


class DistributedTransport(Transport):
    """A weight-update group and a broadcast per bucket."""

    def __init__(self, settings: WeightSyncSettings, mark: Mark):
        super().__init__(settings, mark)
        self._link: Link | None = None  # the main group, kept between pushes
        self._lone: Link | None = None  # a group for one update (resync), left by finish()
        self._active: Link | None = None  # the one the current update sends over
        self._staged: "list[asyncio.Future[list[torch.Tensor]]]" = []  # [bucket 0], packed by prepare()
        self._generation = 0
        self._instance = uuid.uuid4().hex[:8]

    async def connect(self, engines: list[EngineState]) -> None:
        self._link = await self._open(engines)

    async def before_push(self, engines: list[EngineState]) -> None:
        """An engine that reports another weight version than the last one it received was restarted
        (it serves its checkpoint and has left the group): rebuild the group before sending, rather
        than after a failed first attempt."""
        live = [e for e in engines if e.alive and e.version is not None]
        if self._link is None or not live:
            return
        seen = await asyncio.gather(*(e.client.get_weight_version() for e in live), return_exceptions=True)
        restarted = [e.url for e, v in zip(live, seen) if not isinstance(v, BaseException) and str(v) != str(e.version)]
        if restarted:
            logger.info("engines %s were restarted since the last push; rebuilding the weight-update group", restarted)
            link, self._link = self._link, None
            await close_link(link, min(self.settings.timeout_s, 10.0))

    async def prepare(self, members: list[EngineState], payload: Payload, keep: bool = True) -> float:
        """Join (or reuse) the group over ``members``, then pack bucket 0: on the CPU this waits for
        it, so generation loses nothing to it (on a GPU the copies are only queued)."""
        t = time.perf_counter()
        link = await self._relink(members) if keep else await self._open(members)
        if not keep:
            self._lone = link
        self._active = link
        t_link = time.perf_counter()
        try:
            self._staged = [self._pack(link, payload, 0)]
            if link.device.type != "cuda":
                await self._staged[0]
        except BaseException:
            await self.finish()
            raise
        return t_link - t

    async def send(self, members: list[EngineState], payload: Payload, version: int, progress: Progress | None,
                   resume: Resume | None) -> float:
        """Send every bucket over the group (bucket 0 staged by ``prepare``); return the seconds
        spent in transfers. ``resume``: started as soon as the last bucket is answered, while rank 0
        waits for its transfers to end (an engine's next forwards queue on its GPU behind the copies
        of the received weights, and an engine answers the version's last bucket only once those
        copies are queued)."""
        s = self.settings
        link = self._active
        buckets = payload.buckets
        t = time.perf_counter()
        inflight: deque = deque()  # CUDA events of queued transfers (nccl); bounds memory in flight

        def send_one(i: int, packed: list[torch.Tensor],
                     after: Callable[[], None] | None) -> Awaitable[torch.cuda.Event | None]:
            # after_issue starts packing the next bucket: on a GPU queued behind bucket i's
            # broadcast, while its answers come; on the CPU in a thread while this one travels
            return send_bucket(link, self._wire(buckets, i), packed, s,
                               **last_bucket(s, version, i == len(buckets) - 1), after_issue=after)

        async def answered(i: int, ev: "torch.cuda.Event | None") -> None:
            if ev is not None:
                inflight.append((i, ev))
                if len(inflight) >= _MAX_INFLIGHT:
                    j, done = inflight.popleft()
                    await wait_transfer(link, done, s.timeout_s)
                    self.mark("transferred", j)
        await send_buckets(len(buckets), lambda i: self._pack(link, payload, i), send_one, self._staged, progress,
                           self.mark, answered)
        resumed = resume() if resume is not None else None
        try:
            while inflight:
                j, done = inflight.popleft()
                await wait_transfer(link, done, s.timeout_s)
                self.mark("transferred", j)
        finally:
            if resumed is not None:
                await asyncio.gather(resumed, return_exceptions=True)
        if resumed is not None:
            resumed.result()  # a PushFailed from continue_generation
        return time.perf_counter() - t

    async def finish(self) -> None:
        self._active, self._staged = None, []
        if self._lone is not None:
            link, self._lone = self._lone, None
            await close_link(link, self.settings.timeout_s)

    async def after_failure(self, members: list[EngineState], alive: set[str]) -> None:
        """Drop the (now inconsistent) group."""
        if self._link is not None:
            link, self._link = self._link, None
            if not link.broken:  # abort, not a graceful shutdown: NCCL's would wait for dead peers
                await abort_link(link)
            await close_link(link, min(self.settings.timeout_s, 10.0), urls_alive=alive)

    async def close(self, alive: set[str]) -> None:
        if self._link is not None:
            link, self._link = self._link, None
            await close_link(link, self.settings.timeout_s, urls_alive=alive)

    def _wire(self, buckets: list[Bucket], i: int) -> Bucket:
        """The metadata bucket ``i`` travels with (a delta push sends another: ``transports/delta.py``)."""
        return buckets[i]

    @staticmethod
    def _pack(link: Link, payload: Payload, i: int) -> "asyncio.Future[list[torch.Tensor]]":
        return start_packing(lambda: link.pack(payload.named, payload.buckets[i], link.device),
                             here=link.device.type == "cuda")

    async def _open(self, members: list[EngineState]) -> Link:
        self._generation += 1
        # unique per sender: engines started with --engine-urls outlive a trainer restart and may
        # still hold a group of the old trainer's (SGLang refuses a name it already has)
        name = f"{self.settings.group_name}_{self._instance}_{self._generation}"
        return await open_link(self.settings, [(e.url, e.gpus, e.client) for e in members], name)

    async def _relink(self, members: list[EngineState]) -> Link:
        """The main link over exactly ``members`` (rebuilt when membership changed)."""
        if self._link is not None and [m.url for m in members] == self._link.urls:
            return self._link
        if self._link is not None:
            await close_link(self._link, self.settings.timeout_s)
            self._link = None
        self._link = await self._open(members)
        return self._link
