"""The trainer side of weight sync: ``WeightSender`` pushes one version of the weights to engines.

A push of version v (transport ``distributed``):
1. validate every tensor's name, shape and dtype against what each engine reported at connect
   (an error names the tensor; nothing has been sent yet);
2. pack bucket 0 (the engines still generate), then ``/pause_generation`` on every engine
   (``weight_sync/time_s`` is measured from here to the end of 5: what generation loses), then
   ``/begin_weight_update`` (SGLang >= 0.5.22 loads weights only inside that session; a 404 from
   an older server means none is needed);
3. per bucket: POST ``/update_weights_from_distributed`` (names, dtypes, shapes) to every engine
   and, while those requests are in flight, broadcast the bucket from rank 0 (the engines receive
   inside their handlers); the next bucket is packed while the current one travels;
4. ``/end_weight_update``; optionally compare per-tensor checksums (``check_equal``);
5. ``/continue_generation`` (over NCCL without the check: as soon as the last bucket is answered
   and the session closed, while rank 0 waits for its last transfers; an engine's next forwards
   queue on its GPU behind the copies); record v (buffer actor or callback).
A push that fails still closes the session on every engine that answers.
Only the last bucket carries ``weight_version`` (and ``flush_cache``), so an engine reports v only
once all of v is in place. If an engine dies or stalls, the push fails within ``timeout_s``; the
engines still alive stay paused (their weights may be half-updated), the group is rebuilt
without the dead ones and the whole push is redone, so they end at v together. A dead engine that
answers ``/health`` again rejoins at the next push (or at once with ``resync``). Re-pushing a
version is safe (it overwrites the same values).

Transport ``tensor`` (colocated mode: trainer and engines on the same GPUs) has no process group:
the same pause -> begin -> buckets -> end -> continue sequence, and per bucket one POST
``/update_weights_from_tensor`` per engine carrying, for each of its TP ranks, a serialised handle
to the bucket (CUDA IPC on GPUs: the engine maps the trainer's memory and copies from it, nothing
goes through the host; a shared-memory file on the CPU). A bucket is kept flattened (one handle
per bucket, ``load_format`` ``flattened_bucket``) and alive until every engine has answered it (an
engine answers once it has copied it); bucket k+1 is packed while bucket k's requests are in
flight.

With ``load_format`` ``mapped``, the trainer's parameters (``torch.nn.Parameter``: storage that
stays put, updated in place by the optimizer) go first, as handles to themselves in one request
whose ``load_format`` is ``sglang_protocol.held_weights.LOADER`` (SGLang's ``--custom-weight-loader``):
each engine loads them and holds them, so from the second push on it opens no handle, and the
engine casts while it copies (no staging copy on the trainer). Other tensors (gathered or
converted ones, fresh at every push) travel in flattened buckets as above; the last request
carries the version. ``close`` lets the engines drop what they hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import deque
from typing import Callable

import torch

from sglang_protocol import held_weights, tensor_update
from sglang_protocol.client import EngineClient, normalize_url
from weight_sync import disk
from weight_sync._loop import LoopThread
from weight_sync.engines import EngineState, call_all, check_equal, fetch_params
from weight_sync.interfaces import NamedTensors, TensorSpec, VersionSink, WeightSyncSettings
from weight_sync.link import (Link, PushFailed, TensorChannel, abort_link, close_link, open_link, send_bucket,
                              send_tensor_bucket, wait_transfer)
from weight_sync.plan import Bucket, check_against_engine, check_tensors, plan_buckets, push_specs

logger = logging.getLogger(__name__)
GiB = 1024 ** 3
# Buckets queued on the GPU at once (nccl): enough to keep the link busy while the next bucket's
# HTTP round trip runs, few enough that in-flight copies stay a small multiple of bucket_bytes.
_MAX_INFLIGHT = 3


class WeightSender:
    """Pushes weights from trainer rank 0 to SGLang-compatible engines. Synchronous API.

    ``version_sink``: where each pushed version is recorded (a callable ``f(v)`` or the buffer
    actor, via ``set_weight_version.remote(v)``), so the buffer measures staleness. It runs its own
    event loop in a daemon thread; call it from plain trainer code.

    ``post_write(version_dir, engine_urls)`` (disk transport only; slime's
    ``--custom-update-weight-post-write-path``, bound by ``weight_sync.arguments.load_post_write_hook``)
    runs in a worker thread once a version's directory is complete, before any engine is asked to
    load it; if it raises, the push fails naming the flag and no engine loads that version.
    """

    def __init__(self, settings: WeightSyncSettings, version_sink: VersionSink | None = None,
                 post_write: Callable[[str, list[str]], None] | None = None):
        if post_write is not None and settings.transport != "disk":
            raise ValueError(f"post_write (--custom-update-weight-post-write-path) runs after the disk transport "
                             f"writes a version; transport is {settings.transport!r}")
        self.post_write = post_write
        if settings.transport == "auto":  # the launcher resolves auto; used alone, the one that works anywhere
            settings = dataclasses.replace(settings, transport=settings.resolved_transport())
        self._auto_format = settings.load_format == "auto"  # mapped, unless an engine does not allow it
        settings = dataclasses.replace(settings, load_format=settings.resolved_load_format())
        self.settings = settings
        self.version_sink = version_sink
        self.engines: list[EngineState] = []
        self.version: int | None = None
        self._link: Link | None = None
        self._channel = TensorChannel(settings.load_format == "flattened_bucket")  # transport "tensor"
        self._generation = 0
        self._instance = uuid.uuid4().hex[:8]
        self._loop = LoopThread()
        self._closed = False
        # Set to a list to record each push's timeline: (event, bucket index or -1,
        # time.perf_counter()) from pause to continue; bench/weight_sync.py prints it.
        self.trace: list[tuple[str, int, float]] | None = None

    # --- public API --------------------------------------------------------------------------
    def connect(self, engine_urls: list[str], engine_gpus: list[int] | None = None) -> None:
        """Register the engines and (distributed transport) join them in the weight-update group.

        ``engine_gpus[i]``: GPUs (TP ranks) of engine i (default: what each engine's
        ``/server_info`` reports, ``tp_size`` x ``pp_size``); engine i takes ranks from
        ``1 + sum(engine_gpus[:i])``. Also fetches each engine's parameter list for validation.
        """
        if self.engines:
            raise RuntimeError("connect: already connected (call close() first)")
        if not engine_urls:
            raise ValueError("engine_urls: at least one engine is needed")
        gpus = list(engine_gpus) if engine_gpus is not None else None  # None: asked of each engine
        if gpus is not None and (len(gpus) != len(engine_urls) or any(g < 1 for g in gpus)):
            raise ValueError(f"engine_gpus {engine_gpus}: need one count >= 1 per engine url")
        if len(set(engine_urls)) != len(engine_urls):
            raise ValueError(f"engine_urls {engine_urls}: duplicate url")
        try:
            self._loop.run(self._connect(engine_urls, gpus), timeout=self._outer_timeout())
        except BaseException as e:  # leave the sender unconnected, so connect() can be retried
            self._loop.run(self._close(), timeout=self.settings.timeout_s + 5)
            self.engines = []
            if isinstance(e, (ValueError, RuntimeError)):
                raise
            raise RuntimeError(f"connect: {type(e).__name__}: {e}") from e

    def push(self, named_tensors: NamedTensors, version: int,
             progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
        """Push one version of the weights to every live engine; return metrics.

        ``named_tensors``: ``(hf_name, full tensor)`` pairs (e.g. ``backend.named_hf_weights()``);
        consumed once and kept as references for the push (validation needs them all before
        anything is sent). ``progress(done, total)`` is called after each bucket.
        """
        if not self.engines:
            raise RuntimeError("push: not connected (call connect() first)")
        if self.version is not None and version < self.version:
            raise ValueError(f"version {version}: older than the last pushed version {self.version}")
        named = list(named_tensors)
        specs = check_tensors(named)
        for e in self.engines:
            if e.alive and e.params is not None:
                check_against_engine(specs, e.params, e.url, e.tied, e.complete)
        # floating tensors travel in the engines' dtype (cast per bucket while packing)
        sent = push_specs(specs, [e.params for e in self.engines], self.settings.engine_dtype)
        held, buckets = self._plan(named, sent)
        metrics = self._loop.run(self._push(named, sent, buckets, version, progress, held),
                                 timeout=self._outer_timeout(len(buckets) + bool(held)))
        held_set = set(held)  # held tensors travel as they are: the engine casts them while copying
        metrics["weight_sync/cast_tensors"] = float(sum(a.dtype != b.dtype for i, (a, b) in enumerate(zip(specs, sent))
                                                        if i not in held_set))
        self.version = version
        self._record_version(version)
        return metrics

    def resync(self, engine_url: str, named_tensors: NamedTensors | None = None,
               version: int | None = None) -> dict[str, float]:
        """Bring back an engine that died (or missed pushes) once it is reachable again.

        With ``named_tensors``: push them to that engine alone at ``version`` (default: the last
        pushed version) right away; the main group is rebuilt to include it at the next push.
        Without: it rejoins at the next push (until then it serves the weights it has). A push
        also brings back, by itself, every dead engine that answers ``/health`` again.
        """
        e = self._engine(engine_url)
        if named_tensors is not None and version is None and self.version is None:
            raise ValueError("version: nothing was pushed yet; give the version of named_tensors")
        return self._loop.run(self._resync(e, named_tensors, version if version is not None else self.version),
                              timeout=self._outer_timeout())

    def engine_status(self) -> dict[str, dict]:
        """Per engine url: ``alive``, the last ``version`` it fully received, recent ``errors``."""
        return {e.url: {"alive": e.alive, "version": e.version, "errors": list(e.errors[-3:])} for e in self.engines}

    def close(self) -> None:
        """Leave the weight-update group on every engine and free the loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run(self._close(), timeout=self.settings.timeout_s + 5)
        finally:
            self._loop.stop()

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ---------------------------------------------------------------------------
    def _plan(self, named, sent) -> tuple[list[int], list[Bucket]]:
        """``(held, buckets)``: the indices that go as held handles (``mapped``: the parameters) and
        the buckets of the others (indices into ``named``)."""
        mapped = self.settings.transport == "tensor" and self.settings.load_format == "mapped"
        held = [i for i, (_, t) in enumerate(named)
                if mapped and isinstance(t, torch.nn.Parameter) and t.is_contiguous()]
        if not held:
            return [], plan_buckets(sent, self.settings.bucket_bytes)
        rest = sorted(set(range(len(named))) - set(held))
        buckets = plan_buckets([sent[i] for i in rest], self.settings.bucket_bytes)
        return held, [dataclasses.replace(b, indices=[rest[j] for j in b.indices]) for b in buckets]

    def _outer_timeout(self, n_buckets: int = 1) -> float:
        # A backstop only: each HTTP call and collective has its own bound of timeout_s.
        s = self.settings
        return (s.retries + 1) * (n_buckets + 4) * s.timeout_s + 30

    def _engine(self, url: str) -> EngineState:
        for e in self.engines:
            if e.url == normalize_url(url) or e.client.base_url == normalize_url(url):
                return e
        raise ValueError(f"engine_url {url!r}: not one of the connected engines")

    def _mark(self, event: str, bucket: int = -1) -> None:
        if self.trace is not None:
            self.trace.append((event, bucket, time.perf_counter()))

    def _record_version(self, version: int) -> None:
        if self.version_sink is not None:  # the buffer's: buffer.retry.BufferVersionSink (survives its restart)
            self.version_sink(version)

    async def _connect(self, urls: list[str], gpus: list[int] | None) -> None:
        t = self.settings.timeout_s
        self.engines = [EngineState(normalize_url(u), 1, EngineClient(u, timeout=t, api_key=self.settings.api_key,
                                                                admin_api_key=self.settings.admin_api_key),
                                    check_equal=self.settings.check_equal) for u in urls]
        await asyncio.gather(*(fetch_params(e, self.settings.timeout_s) for e in self.engines))
        if gpus is None:  # each engine joins the group with one rank per GPU (SGLang: rank_offset + tp_rank)
            gpus = await asyncio.gather(*(_gpu_count(e) for e in self.engines))
        for e, g in zip(self.engines, gpus):
            e.gpus = g
        if self.settings.transport == "tensor" and self.settings.load_format == "mapped":
            refused = await asyncio.gather(*(_check_loader_allowed(e) for e in self.engines), return_exceptions=True)
            refused = [r for r in refused if isinstance(r, BaseException)]
            if refused and not self._auto_format:
                raise refused[0]
            if refused:  # auto: the format every engine takes
                logger.warning("weight sync: flattened buckets, not mapped: %s", refused[0])
                self.settings = dataclasses.replace(self.settings, load_format="flattened_bucket")
        if self.settings.transport == "distributed":
            self._link = await self._open(self.engines)

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

    async def _revive(self, specs: list[TensorSpec]) -> int:
        """Engines marked dead that answer /health again rejoin now (their parameter list is
        fetched anew and the push validated against it), so they get this push with the others.
        Returns how many came back."""
        dead = [e for e in self.engines if not e.alive]
        if not dead:
            return 0
        healthy = await asyncio.gather(*(e.client.health(timeout=min(2.0, self.settings.timeout_s)) for e in dead))
        back = 0
        for e, ok in zip(dead, healthy):
            if not ok:
                continue
            await fetch_params(e, self.settings.timeout_s)
            if e.params is not None:
                check_against_engine(specs, e.params, e.url, e.tied, e.complete)
            logger.info("engine %s answers again; it rejoins with this push", e.url)
            e.alive, back = True, back + 1
        return back

    async def _wait_for_engine(self, specs: list[TensorSpec], version: int) -> int:
        """No engine is live: poll the dead ones until one answers ``/health`` again (restarted, it
        serves its checkpoint; this push brings it to ``version`` before the fleet lets it serve),
        at most ``engine_wait_s``. Returns how many came back (0: none in time)."""
        s = self.settings
        logger.warning("push v%d: no live engine; waiting up to %.0f s for one to come back (a restarted engine "
                       "gets this push before it serves again)", version, s.engine_wait_s)
        deadline = time.monotonic() + s.engine_wait_s
        while time.monotonic() < deadline:
            back = await self._revive(specs)
            if back:
                logger.warning("push v%d: %d engine(s) back after %.1f s", version, back,
                               s.engine_wait_s - (deadline - time.monotonic()))
                return back
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        return 0

    async def _drop_link_if_restarted(self) -> None:
        """An engine that reports another weight version than the last one it received was restarted
        (it serves its checkpoint and has left the group): rebuild the group before sending, rather
        than after a failed first attempt."""
        live = [e for e in self.engines if e.alive and e.version is not None]
        if self._link is None or not live:
            return
        seen = await asyncio.gather(*(e.client.get_weight_version() for e in live), return_exceptions=True)
        restarted = [e.url for e, v in zip(live, seen) if not isinstance(v, BaseException) and str(v) != str(e.version)]
        if restarted:
            logger.info("engines %s were restarted since the last push; rebuilding the weight-update group", restarted)
            link, self._link = self._link, None
            await close_link(link, min(self.settings.timeout_s, 10.0))

    async def _push(self, named, specs, buckets, version, progress, held=()) -> dict[str, float]:
        s = self.settings
        # what the engines read: the buckets, and the held tensors as the trainer holds them
        total_bytes = sum(b.nbytes for b in buckets) + sum(named[i][1].nbytes for i in held)
        last_error: Exception | None = None
        revived = await self._revive(specs)
        await self._drop_link_if_restarted()
        for attempt in range(s.retries + 1):
            members = [e for e in self.engines if e.alive]
            if not members and s.engine_wait_s > 0:  # the fleet restarts dead engines: wait for one
                revived += await self._wait_for_engine(specs, version)
                members = [e for e in self.engines if e.alive]
            if not members:
                raise RuntimeError(f"push v{version}: no live engine left ({self.engine_status()})") from last_error
            t0 = time.perf_counter()
            try:
                if s.transport == "distributed":
                    link = await self._relink(members)
                t_link = time.perf_counter()
                first = None
                if s.transport == "distributed":  # before the pause: the engines generate meanwhile
                    first = self._pack_first(link, named, buckets[0])
                    if link.device.type != "cuda":
                        await first
                elif s.transport == "tensor":
                    self._channel.flattened = s.load_format != "tensor"
                    staged = [await self._pack_tensors(named, buckets[0])] if buckets else []
                t_pause = time.perf_counter()  # generation stops from here
                self._mark("pause")
                await call_all(members, lambda c: c.pause_generation(s.pause_mode), "pause_generation")
                t_paused = time.perf_counter()
                self._mark("paused")
                resume = None if s.check_equal else members  # continue while the last transfers end
                if s.transport == "distributed":
                    await _begin_session(members, s.timeout_s)
                    bcast_s = await self._send_all(link, named, buckets, version, progress, first, resume)
                    if resume is None:
                        await _end_session(members, s.timeout_s)
                elif s.transport == "tensor":
                    await _begin_session(members, s.timeout_s)
                    bcast_s = await self._send_tensors(members, named, buckets, version, progress, staged, held)
                    await _end_session(members, s.timeout_s)
                else:
                    bcast_s = await self._send_disk(members, named, version)
                check_s = await check_equal(members, named, s.timeout_s, specs) if s.check_equal else 0.0
                t_checked = time.perf_counter()
                if s.transport != "distributed" or resume is None:
                    self._mark("continue")
                    await call_all(members, lambda c: c.continue_generation(), "continue_generation")
                t1 = time.perf_counter()
                self._mark("continued")
            except PushFailed as err:
                last_error = err
                logger.warning("push v%d attempt %d failed: %s", version, attempt + 1, err)
                await self._after_failure(members, err)
                continue
            for e in members:
                e.version = version
            pause_to_continue = t1 - t_pause  # what generation loses to the push
            return {"weight_sync/time_s": pause_to_continue,
                    "weight_sync/gib_per_s": total_bytes / GiB / max(pause_to_continue - check_s, 1e-9),
                    "weight_sync/transfer_s": bcast_s, "weight_sync/pause_s": t_paused - t_pause,
                    "weight_sync/continue_s": t1 - t_checked, "weight_sync/check_s": check_s,
                    "weight_sync/connect_s": t_link - t0, "weight_sync/pack_first_s": t_pause - t_link,
                    "weight_sync/total_s": t1 - t0,
                    "weight_sync/bytes": float(total_bytes), "weight_sync/num_buckets": float(len(buckets)),
                    "weight_sync/held_tensors": float(len(held)),
                    "weight_sync/num_tensors": float(len(specs)), "weight_sync/engines": float(len(members)),
                    "weight_sync/attempts": float(attempt + 1), "weight_sync/version": float(version),
                    "weight_sync/revived": float(revived)}
        raise RuntimeError(f"push v{version}: failed after {s.retries + 1} attempts; live engines are left "
                           f"paused (their weights may be partly updated); engines: {self.engine_status()}") \
            from last_error

    @staticmethod
    def _pack_first(link: Link, named, bucket) -> "asyncio.Future":
        """Start packing a bucket: on a GPU right here (it only queues the copies); on the CPU
        in a worker thread. ``_push`` packs bucket 0 before the engines pause (on the CPU it
        waits for it), so generation loses nothing to it."""
        loop = asyncio.get_running_loop()
        if link.device.type == "cuda":
            fut = loop.create_future()
            fut.set_result(link.pack(named, bucket, link.device))
            return fut
        return loop.run_in_executor(None, link.pack, named, bucket, link.device)

    async def _send_all(self, link: Link, named, buckets, version: int, progress, first=None,
                        resume: list[EngineState] | None = None) -> float:
        """Send every bucket over ``link`` (``first``: bucket 0 already being packed); return the
        seconds spent in transfers. ``resume``: engines to send ``/continue_generation`` as soon
        as the last bucket is answered, while rank 0 waits for its transfers to end (an engine's
        next forwards queue on its GPU behind the copies of the received weights, and an engine
        answers the version's last bucket only once those copies are queued)."""
        s = self.settings
        dev = link.device
        loop = asyncio.get_running_loop()
        flat_next = first if first is not None else self._pack_first(link, named, buckets[0])
        t = time.perf_counter()
        inflight: deque = deque()  # CUDA events of queued transfers (nccl); bounds memory in flight
        nxt: list = []

        def pack_next(i: int) -> None:  # GPU: queued behind bucket i's broadcast, while its answers come
            nxt.append(self._pack_first(link, named, buckets[i + 1]))

        for i, b in enumerate(buckets):
            packed = await flat_next
            self._mark("packed", i)
            after = None
            if i + 1 < len(buckets):
                if dev.type == "cuda":
                    after = lambda i=i: pack_next(i)  # noqa: E731
                else:  # pack the next bucket in a thread while this one travels
                    flat_next = loop.run_in_executor(None, link.pack, named, buckets[i + 1], dev)
            last = i == len(buckets) - 1
            ev = await send_bucket(link, b, packed, s, weight_version=str(version) if last else None,
                                   flush_cache=last and s.pause_mode != "in_place", after_issue=after)
            self._mark("answered", i)
            del packed
            if nxt:
                flat_next = nxt.pop()
            if ev is not None:
                inflight.append((i, ev))
                if len(inflight) >= _MAX_INFLIGHT:
                    j, done = inflight.popleft()
                    await wait_transfer(link, done, s.timeout_s)
                    self._mark("transferred", j)
            if progress is not None:
                progress(i + 1, len(buckets))
        resumed = None
        if resume is not None:
            self._mark("continue")
            resumed = asyncio.ensure_future(_end_session(resume, s.timeout_s, then_continue=True))
        try:
            while inflight:
                j, done = inflight.popleft()
                await wait_transfer(link, done, s.timeout_s)
                self._mark("transferred", j)
        finally:
            if resumed is not None:
                await asyncio.gather(resumed, return_exceptions=True)
        if resumed is not None:
            resumed.result()  # a PushFailed from continue_generation
        return time.perf_counter() - t

    def _pack_tensors(self, named, bucket) -> "asyncio.Future":
        """Start packing a bucket for the tensor transport: on a GPU right here (it only queues
        the copies), on the CPU in a worker thread."""
        loop = asyncio.get_running_loop()
        if named[bucket.indices[0]][1].is_cuda:
            fut = loop.create_future()
            fut.set_result(self._channel.pack(named, bucket))
            return fut
        return loop.run_in_executor(None, self._channel.pack, named, bucket)

    async def _send_tensors(self, members: list[EngineState], named, buckets, version: int, progress,
                            staged: list | None = None, held=()) -> float:
        """Send the held tensors (``mapped``), then every bucket with the tensor transport
        (``staged``: ``[bucket 0 packed]``, emptied here); return the seconds spent sending. Bucket
        k+1 is packed while bucket k's requests are in flight; bucket k is let go once every engine
        has answered it (each has copied it by then): packed buckets are held in lists that are
        emptied, so no frame keeps one longer."""
        s = self.settings
        peers = [(e.url, e.gpus, e.client) for e in members]
        t = time.perf_counter()
        if held:
            pairs = held_weights.pack([(named[i][0], named[i][1].detach()) for i in held])
            if pairs[0][1].is_cuda:  # an engine that finds these storages mapped already waits for no
                torch.cuda.synchronize(pairs[0][1].device)  # event of ours: the trainer's writes end first
            last = not buckets
            await send_tensor_bucket(held_weights.LOADER, peers, pairs, s, weight_version=str(version) if last else None,
                                     flush_cache=last and s.pause_mode != "in_place")
            self._mark("held")
        if not buckets:
            return time.perf_counter() - t
        staged = staged if staged else [await self._pack_tensors(named, buckets[0])]
        for i in range(len(buckets)):
            obj, keep = staged.pop()
            self._mark("packed", i)
            last = i == len(buckets) - 1
            pending: list = []

            def pack_next(i: int = i) -> None:
                pending.append(self._pack_tensors(named, buckets[i + 1]))
            try:
                await send_tensor_bucket(tensor_update.FLATTENED if self._channel.flattened else None, peers, obj, s,
                                         weight_version=str(version) if last else None,
                                         flush_cache=last and s.pause_mode != "in_place",
                                         after_issue=None if last else pack_next)
            except BaseException:
                await asyncio.gather(*pending, return_exceptions=True)  # CPU: a thread may still fill a slot
                raise
            self._mark("answered", i)
            del obj, keep
            if pending:
                staged.append(await pending.pop())
            if progress is not None:
                progress(i + 1, len(buckets))
        return time.perf_counter() - t

    async def _send_disk(self, members: list[EngineState], named, version: int) -> float:
        s = self.settings
        loop = asyncio.get_running_loop()
        path = await loop.run_in_executor(None, disk.write_hf_checkpoint, named, s.disk_dir, version,
                                          s.hf_checkpoint, s.disk_keep)
        if self.post_write is not None:
            urls = [e.url for e in members]
            try:
                await loop.run_in_executor(None, self.post_write, str(path), urls)
            except Exception as e:  # the user's hook: the engines must not load what it did not publish
                raise RuntimeError(f"push v{version}: --custom-update-weight-post-write-path failed on {path}: "
                                   f"{type(e).__name__}: {e}") from e
        t = time.perf_counter()
        await call_all(members, lambda c: c.update_weights_from_disk(str(path), str(version),
                                                                      timeout=s.timeout_s),
                        "update_weights_from_disk")
        return time.perf_counter() - t

    async def _after_failure(self, members: list[EngineState], err: PushFailed) -> None:
        """Mark engines that stopped answering as dead, close the weight-update session on the
        others and drop the (now inconsistent) group."""
        healthy = await asyncio.gather(*(e.client.health(timeout=min(5.0, self.settings.timeout_s))
                                         for e in members))
        if self.settings.transport != "disk":  # best effort: "no session open" is fine too
            await asyncio.gather(*(e.client.end_weight_update(min(10.0, self.settings.timeout_s))
                                   for e, ok in zip(members, healthy) if ok), return_exceptions=True)
        for e, ok in zip(members, healthy):
            if e.url in err.failed:
                e.errors.append(err.failed[e.url])
            if not ok:
                logger.warning("engine %s is not answering; it is left out until resync()", e.url)
                e.alive = False
                e.version = None
        if self._link is not None:
            link, self._link = self._link, None
            if not link.broken:  # abort, not a graceful shutdown: NCCL's would wait for dead peers
                await abort_link(link)
            await close_link(link, min(self.settings.timeout_s, 10.0),
                             urls_alive={e.url for e, ok in zip(members, healthy) if ok})

    async def _resync(self, e: EngineState, named_tensors, version) -> dict[str, float]:
        if not await e.client.health(timeout=min(10.0, self.settings.timeout_s)):
            raise RuntimeError(f"resync: engine {e.url} is not answering /health")
        await fetch_params(e, self.settings.timeout_s)  # a restarted engine may report a different list
        e.alive, e.version = True, None
        if named_tensors is None:
            return {}
        named = list(named_tensors)
        specs = check_tensors(named)
        if e.params is not None:
            check_against_engine(specs, e.params, e.url, e.tied, e.complete)
        specs = push_specs(specs, [e.params], self.settings.engine_dtype)
        held, buckets = self._plan(named, specs)
        s = self.settings
        t0 = time.perf_counter()
        if s.transport == "disk":
            await call_all([e], lambda c: c.pause_generation(s.pause_mode), "pause_generation")
            await self._send_disk([e], named, version)
        elif s.transport == "tensor":
            self._channel.flattened = s.load_format != "tensor"
            await call_all([e], lambda c: c.pause_generation(s.pause_mode), "pause_generation")
            await _begin_session([e], s.timeout_s)
            try:
                await self._send_tensors([e], named, buckets, version, None, held=held)
            finally:
                await _end_session([e], s.timeout_s)
        else:
            link = await self._open([e])  # a group of the trainer and this engine only
            try:
                await call_all([e], lambda c: c.pause_generation(s.pause_mode), "pause_generation")
                await _begin_session([e], s.timeout_s)
                try:
                    await self._send_all(link, named, buckets, version, None)
                finally:
                    await _end_session([e], s.timeout_s)
            finally:
                await close_link(link, s.timeout_s)
        if s.check_equal:
            await check_equal([e], named, s.timeout_s, specs)
        await call_all([e], lambda c: c.continue_generation(), "continue_generation")
        e.version = version
        return {"weight_sync/resync_s": time.perf_counter() - t0}

    async def _close(self) -> None:
        if self.settings.transport == "tensor" and self.settings.load_format == "mapped" and self.version is not None:
            await _release_held([e for e in self.engines if e.alive], self.settings)
        if self._link is not None:
            link, self._link = self._link, None
            await close_link(link, self.settings.timeout_s, urls_alive={e.url for e in self.engines if e.alive})
        for e in self.engines:
            await e.client.close()
        await asyncio.sleep(0.05)  # aiohttp closes transports on the next loop iterations


async def _gpu_count(e: EngineState) -> int:
    """Engine ``e``'s GPUs from its ``/server_info``; RuntimeError naming it when that cannot be read."""
    try:
        return await e.client.gpu_count()
    except Exception as err:
        raise RuntimeError(f"engine {e.url}: cannot read /server_info for its GPU count (pass engine_gpus): "
                           f"{err}") from err


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


async def _release_held(members: list[EngineState], settings: WeightSyncSettings) -> None:
    """Let the engines drop the trainer's tensors they hold (an empty list to the loader), inside
    a session; best effort (the sender is closing): failures are logged."""
    peers = [(e.url, e.gpus, e.client) for e in members]
    try:
        await _begin_session(members, settings.timeout_s)
        try:
            await send_tensor_bucket(held_weights.LOADER, peers, [], settings, None, flush_cache=False)
        finally:
            await _end_session(members, settings.timeout_s)
    except Exception as e:
        logger.warning("close: engines may still hold the trainer's tensors: %s", e)


_SESSION_OPEN = "a weight-update session is already open"  # SGLang's refusal of a second begin


async def _begin_session(members: list[EngineState], timeout_s: float) -> None:
    """``/begin_weight_update`` on every member. One that refuses because a session is already open
    (a trainer before this one died inside a push: engines given by --engine-urls outlive it) gets
    that session closed and is asked once more; PushFailed naming each engine that still fails."""
    try:
        await call_all(members, lambda c: c.begin_weight_update(timeout_s), "begin_weight_update")
    except PushFailed as e:
        stale = [m for m in members if _SESSION_OPEN in e.failed.get(m.url, "")]
        if not stale or len(stale) < len(e.failed):
            raise
        for m in stale:
            logger.warning("engine %s had a weight-update session open (a previous trainer stopped inside a "
                           "push); closing it", m.url)
        await call_all(stale, lambda c: c.end_weight_update(timeout_s), "end_weight_update")
        await call_all(stale, lambda c: c.begin_weight_update(timeout_s), "begin_weight_update")


async def _end_session(members: list[EngineState], timeout_s: float, then_continue: bool = False) -> None:
    """``/end_weight_update`` on every member (a 404 from an older server is fine), then
    ``/continue_generation`` if asked; PushFailed naming each engine that failed."""
    await call_all(members, lambda c: c.end_weight_update(timeout_s), "end_weight_update")
    if then_continue:
        await call_all(members, lambda c: c.continue_generation(), "continue_generation")
