"""The trainer side of weight sync: ``WeightSender`` pushes one version of the weights to engines.

A push of version v:
1. validate every tensor's name, shape and dtype against what each engine reported at connect
   (an error names the tensor; nothing has been sent yet); floating tensors travel in the
   engines' dtype (cast while a bucket is packed);
2. the transport (``weight_sync/transports/``: ``distributed``, ``tensor`` or ``disk``, chosen once
   from the settings) prepares while the engines still generate (joins the group, packs bucket 0);
   ``/pause_generation`` on every engine (``weight_sync/time_s`` runs from here to the end of 5: what
   generation loses), then ``/begin_weight_update`` (SGLang >= 0.5.22 loads weights only inside that
   session; a 404 from an older server means none is needed; ``disk`` opens none);
3. the transport sends the buckets;
4. ``/end_weight_update``; optionally compare per-tensor checksums (``check_equal``);
5. ``/continue_generation`` (over NCCL without the check, 4 and 5 start as soon as the last bucket
   is answered, while rank 0 waits for its last transfers); record v (buffer actor or callback).
``_sequence`` is that sequence, once: for a push, a resync, and the release of held tensors at close.
Only the last bucket carries ``weight_version`` (and ``flush_cache``), so an engine reports v only
once all of v is in place. If an engine dies or stalls, the push fails within ``timeout_s``; the
session is closed on every engine that answers, the engines still alive stay paused (their weights
may be half-updated), the transport drops its group, and the whole push is redone without the dead
ones, so they end at v together. A dead engine that answers ``/health`` again rejoins at the next
push (or at once with ``resync``). Re-pushing a version is safe (it overwrites the same values).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from typing import Awaitable, Callable, NamedTuple

from sglang_protocol.client import EngineClient, normalize_url
from weight_sync._loop import LoopThread
from weight_sync.engines import EngineState, call_all, check_equal, fetch_params
from weight_sync.interfaces import NamedTensors, TensorSpec, VersionSink, WeightSyncSettings
from weight_sync.link import PushFailed
from weight_sync.plan import check_against_engine, check_tensors, push_specs
from weight_sync.transports import PostWrite, make_transport
from weight_sync.transports.base import Named, Payload, Progress, Resume

logger = logging.getLogger(__name__)
GiB = 1024 ** 3


class _Timeline(NamedTuple):
    """``time.perf_counter()`` points and durations of one ``_sequence``."""

    pause: float  # /pause_generation sent: generation stops from here
    paused: float
    send_s: float  # the transport's send
    check_s: float
    checked: float
    continued: float  # /continue_generation answered


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
                 post_write: PostWrite | None = None):
        if post_write is not None and settings.transport != "disk":
            raise ValueError(f"post_write (--custom-update-weight-post-write-path) runs after the disk transport "
                             f"writes a version; transport is {settings.transport!r}")
        self.post_write = post_write
        if settings.transport == "auto":  # the launcher resolves auto; used alone, the one that works anywhere
            settings = dataclasses.replace(settings, transport=settings.resolved_transport())
        auto_format = settings.load_format == "auto"  # mapped, unless an engine does not allow it
        settings = dataclasses.replace(settings, load_format=settings.resolved_load_format())
        self.settings = settings  # our own copy, shared with the transport
        self.version_sink = version_sink
        self.engines: list[EngineState] = []
        self.version: int | None = None
        self._transport = make_transport(settings, self._mark, post_write, auto_format)
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

    def push(self, named_tensors: NamedTensors, version: int, progress: Progress | None = None) -> dict[str, float]:
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
        payload = self._transport.plan(named, sent)
        metrics = self._loop.run(self._push(payload, sent, version, progress),
                                 timeout=self._outer_timeout(len(payload.buckets) + bool(payload.held)))
        held_set = set(payload.held)  # held tensors travel as they are: the engine casts them while copying
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
        await self._transport.connect(self.engines)

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

    async def _push(self, payload: Payload, specs: list[TensorSpec], version: int,
                    progress: Progress | None) -> dict[str, float]:
        s = self.settings
        last_error: Exception | None = None
        revived = await self._revive(specs)
        await self._transport.before_push(self.engines)
        for attempt in range(s.retries + 1):
            members = [e for e in self.engines if e.alive]
            if not members and s.engine_wait_s > 0:  # the fleet restarts dead engines: wait for one
                revived += await self._wait_for_engine(specs, version)
                members = [e for e in self.engines if e.alive]
            if not members:
                raise RuntimeError(f"push v{version}: no live engine left ({self.engine_status()})") from last_error
            t0 = time.perf_counter()
            try:
                connect_s = await self._transport.prepare(members, payload)  # the engines generate meanwhile
                send = functools.partial(self._transport.send, members, payload, version, progress)
                # without the check, the transport may continue the engines while its last transfers end
                tl = await self._sequence(members, send, payload.named, specs, early_continue=not s.check_equal,
                                          end_on_error=False)
            except PushFailed as err:
                last_error = err
                logger.warning("push v%d attempt %d failed: %s", version, attempt + 1, err)
                await self._after_failure(members, err)
                continue
            for e in members:
                e.version = version
            pause_to_continue = tl.continued - tl.pause  # what generation loses to the push
            return {"weight_sync/time_s": pause_to_continue,
                    "weight_sync/gib_per_s": payload.nbytes / GiB / max(pause_to_continue - tl.check_s, 1e-9),
                    "weight_sync/transfer_s": tl.send_s, "weight_sync/pause_s": tl.paused - tl.pause,
                    "weight_sync/continue_s": tl.continued - tl.checked, "weight_sync/check_s": tl.check_s,
                    "weight_sync/connect_s": connect_s, "weight_sync/pack_first_s": tl.pause - t0 - connect_s,
                    "weight_sync/total_s": tl.continued - t0,
                    "weight_sync/bytes": float(payload.nbytes), "weight_sync/num_buckets": float(len(payload.buckets)),
                    "weight_sync/held_tensors": float(len(payload.held)),
                    "weight_sync/num_tensors": float(len(specs)), "weight_sync/engines": float(len(members)),
                    "weight_sync/attempts": float(attempt + 1), "weight_sync/version": float(version),
                    "weight_sync/revived": float(revived)}
        raise RuntimeError(f"push v{version}: failed after {s.retries + 1} attempts; live engines are left "
                           f"paused (their weights may be partly updated); engines: {self.engine_status()}") \
            from last_error

    async def _sequence(self, members: list[EngineState], send: Callable[[Resume | None], Awaitable[float | None]],
                        named: Named | None = None, specs: list[TensorSpec] | None = None, *, generating: bool = True,
                        early_continue: bool = False, end_on_error: bool = True) -> _Timeline:
        """SGLang's update sequence on ``members``, the one copy of it: ``/pause_generation`` ->
        ``/begin_weight_update`` -> ``send(resume)`` -> ``/end_weight_update`` -> the transport's
        ``finish`` -> ``check_equal`` of ``named`` (if set) -> ``/continue_generation``. No session
        where the transport opens none (disk); no pause nor continue unless ``generating``.
        ``early_continue``: ``send`` gets a ``resume`` that starts the end and the continue at once.
        ``end_on_error``: a failed send ends the session here (a push leaves it to ``_after_failure``)."""
        s, tr = self.settings, self._transport
        resumed = False

        def resume() -> "asyncio.Future[None]":
            nonlocal resumed
            resumed = True
            self._mark("continue")
            return asyncio.ensure_future(_end_session(members, s.timeout_s, then_continue=True,
                                                      session=tr.sessions))
        t_pause = time.perf_counter()  # generation stops from here
        try:
            if generating:
                self._mark("pause")
                await call_all(members, lambda c: c.pause_generation(s.pause_mode), "pause_generation")
                self._mark("paused")
            t_paused = time.perf_counter()
            if tr.sessions:
                await _begin_session(members, s.timeout_s)
            try:
                send_s = await send(resume if early_continue else None)
            except BaseException:
                if end_on_error and tr.sessions and not resumed:
                    await _end_session(members, s.timeout_s)
                raise
            if tr.sessions and not resumed:
                await _end_session(members, s.timeout_s)
        finally:
            await tr.finish()
        check_s = await check_equal(members, named, s.timeout_s, specs) if s.check_equal and named is not None else 0.0
        t_checked = time.perf_counter()
        if generating and not resumed:
            self._mark("continue")
            await call_all(members, lambda c: c.continue_generation(), "continue_generation")
        t1 = time.perf_counter()
        if generating:
            self._mark("continued")
        return _Timeline(t_pause, t_paused, send_s or 0.0, check_s, t_checked, t1)

    async def _after_failure(self, members: list[EngineState], err: PushFailed) -> None:
        """Mark engines that stopped answering as dead, close the weight-update session on the
        others and let the transport drop what it built for them (the group)."""
        healthy = await asyncio.gather(*(e.client.health(timeout=min(5.0, self.settings.timeout_s))
                                         for e in members))
        if self._transport.sessions:  # best effort: "no session open" is fine too
            await asyncio.gather(*(e.client.end_weight_update(min(10.0, self.settings.timeout_s))
                                   for e, ok in zip(members, healthy) if ok), return_exceptions=True)
        for e, ok in zip(members, healthy):
            if e.url in err.failed:
                e.errors.append(err.failed[e.url])
            if not ok:
                logger.warning("engine %s is not answering; it is left out until resync()", e.url)
                e.alive = False
                e.version = None
        await self._transport.after_failure(members, {e.url for e, ok in zip(members, healthy) if ok})

    async def _resync(self, e: EngineState, named_tensors: NamedTensors | None,
                      version: int | None) -> dict[str, float]:
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
        payload = self._transport.plan(named, specs)
        t0 = time.perf_counter()
        await self._transport.prepare([e], payload, keep=False)  # distributed: a group of the trainer and e only
        await self._sequence([e], functools.partial(self._transport.send, [e], payload, version, None), named, specs)
        e.version = version
        return {"weight_sync/resync_s": time.perf_counter() - t0}

    async def _release_held(self, members: list[EngineState]) -> None:
        """Let the engines drop the trainer's tensors they hold, inside a session; best effort (the
        sender is closing): failures are logged."""
        try:
            await self._sequence(members, lambda _: self._transport.release(members), generating=False)
        except Exception as e:
            logger.warning("close: engines may still hold the trainer's tensors: %s", e)

    async def _close(self) -> None:
        alive = [e for e in self.engines if e.alive]
        if self._transport.holds_weights and self.version is not None:
            await self._release_held(alive)
        await self._transport.close({e.url for e in alive})
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


async def _end_session(members: list[EngineState], timeout_s: float, then_continue: bool = False,
                       session: bool = True) -> None:
    """``/end_weight_update`` on every member (a 404 from an older server is fine; none unless
    ``session``), then ``/continue_generation`` if asked; PushFailed naming each engine that failed."""
    if session:
        await call_all(members, lambda c: c.end_weight_update(timeout_s), "end_weight_update")
    if then_continue:
        await call_all(members, lambda c: c.continue_generation(), "continue_generation")
