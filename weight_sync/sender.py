"""The trainer side of weight sync: ``WeightSender`` pushes one version of the weights to engines.

A push of version v:
1. validate every tensor's name, shape and dtype against what each engine reported at connect (an
   error names the tensor; nothing is sent yet); floating tensors travel in the engines' dtype;
2. the transport (``weight_sync/transports/``, chosen once from the settings) prepares while the
   engines still generate; ``/pause_generation`` on every engine (``weight_sync/time_s`` runs from
   here to the end of 5: what generation loses), then ``/begin_weight_update``;
3. the transport sends the buckets (it may start 4 and 5 before its last transfers end);
4. ``/end_weight_update``, the transport's ``finish``; optionally compare the weights (``check_equal``);
5. ``/continue_generation``; record v (``version_sink``).
``_sequence`` is 2-5, once: for a push, a resync, and the release of held tensors at close. Only
the last bucket carries ``weight_version``, so an engine reports v only once all of v is in place.
If an engine dies or stalls, the push fails within ``timeout_s``; the session is closed on every
engine that answers, the live engines stay paused (their weights may be half-updated), the
transport drops what it built for them, and the whole push is redone without the dead ones, so
they end at v together. A dead engine that answers ``/health`` again rejoins at the next push (or
at once with ``resync``). Re-pushing a version is safe (it overwrites the same values).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable, NamedTuple

from metric_keys import WEIGHT_VERSION_RECORD_TIME
from sglang_protocol.client import normalize_url
from weight_sync._loop import LoopThread
from weight_sync.engines import (EngineState, begin_session, call_all, check_equal, end_session, fetch_params,
                                 gpu_count)
from weight_sync.interfaces import Named, NamedTensors, TensorSpec, VersionSink, WeightSyncSettings
from weight_sync.link import PushFailed
from weight_sync.plan import check_tensors, push_specs
from weight_sync.transports import PostWrite, make_transport
from weight_sync.transports.base import Payload, Progress, Resume

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


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

    It runs its own event loop in a daemon thread; call it from plain trainer code.
    ``version_sink``: where each pushed version is recorded, so the buffer measures staleness.
    ``post_write``: the disk transport's hook (``weight_sync.transports.disk``; ValueError otherwise).
    """

    def __init__(self, settings: WeightSyncSettings, version_sink: VersionSink | None = None,
                 post_write: PostWrite | None = None) -> None:
        self._transport = make_transport(settings, self._mark, post_write)
        self.settings = self._transport.settings  # our own copy (transport and load format resolved), shared
        self.version_sink = version_sink
        self.engines: list[EngineState] = []
        self.version: int | None = None
        self._loop = LoopThread()
        self._closed = False
        # a list records each push's timeline, (event, bucket or -1, perf_counter()); bench/weight_sync.py prints it
        self.trace: list[tuple[str, int, float]] | None = None
        self._adapter = None  # weight_sync.lora.AdapterPush, made at the first push_adapter

    # --- public API --------------------------------------------------------------------------
    def connect(self, engine_urls: list[str], engine_gpus: list[int] | None = None) -> None:
        """Register the engines and let the transport join them (distributed: the weight-update group).

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

    def set_engines(self, engine_urls: list[str], engine_gpus: list[int]) -> None:
        """Follow an elastic fleet (``engine_gpus[i]``: engine i's GPUs, as for ``connect``). Engines
        not in ``engine_urls`` leave: the next push rebuilds the group without them. New ones join
        at the next push, as an engine that came back does (``_revive``: its parameter list fetched
        and the push validated against it), which brings them to the pushed version."""
        if not self.engines:
            raise RuntimeError("set_engines: not connected (call connect() first)")
        if len(engine_gpus) != len(engine_urls) or any(g < 1 for g in engine_gpus):
            raise ValueError(f"engine_gpus {engine_gpus}: need one count >= 1 per engine url")
        wanted = dict(zip(map(normalize_url, engine_urls), engine_gpus))
        if not wanted:
            raise ValueError("engine_urls: at least one engine is needed")
        self._loop.run(self._set_engines(wanted), timeout=30)

    async def _set_engines(self, wanted: dict[str, int]) -> None:
        """``set_engines`` on the loop (the engines' clients live there)."""
        gone = [e for e in self.engines if e.url not in wanted]
        kept = [e for e in self.engines if e.url in wanted]
        for url in [u for u in wanted if u not in {e.url for e in kept}]:
            e = EngineState.of(url, self.settings)
            e.gpus, e.alive = wanted[url], False  # joins at the next push once it answers /health
            kept.append(e)
        self.engines = kept
        for e in gone:
            await e.client.close()

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
        specs, sent, payload = self._plan(named_tensors, self.engines)
        metrics = self._loop.run(self._push(payload, sent, version, progress),
                                 timeout=self._outer_timeout(len(payload.buckets) + bool(payload.held)))
        metrics["weight_sync/cast_tensors"] = float(payload.cast_tensors(specs, sent))
        metrics.update(self._transport.metrics())
        self.version = version
        if self.version_sink is not None:  # the buffer's: buffer.retry.BufferVersionSink (survives its restart)
            t0 = time.perf_counter()
            self.version_sink(version)
            metrics[WEIGHT_VERSION_RECORD_TIME.key] = time.perf_counter() - t0
        return metrics

    def push_adapter(self, config: dict, tensors: dict[str, "torch.Tensor"], version: int,
                     record: bool = True) -> dict[str, float]:
        """Push a LoRA adapter (peft's ``adapter_config`` and tensors) as version ``version``: only the
        adapter travels (``weight_sync/lora.py``); the engines serve the base plus it under
        ``POLICY_ADAPTER``. Records ``version`` like :meth:`push` (not with ``record`` False: the
        initial adapter, which the engines need before the first rollout names it)."""
        from weight_sync.lora import AdapterPush

        if not self.engines:
            raise RuntimeError("push_adapter: not connected (call connect() first)")
        if self.version is not None and version < self.version:
            raise ValueError(f"version {version}: older than the last pushed version {self.version}")
        if self._adapter is None:
            self._adapter = AdapterPush(self.settings)
        metrics = self._loop.run(self._adapter.push(self.engines, config, tensors, version),
                                 timeout=self._outer_timeout(8))
        self.version = version
        if self.version_sink is not None and record:
            t0 = time.perf_counter()
            self.version_sink(version)
            metrics[WEIGHT_VERSION_RECORD_TIME.key] = time.perf_counter() - t0
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
        if self._adapter is not None:
            self._adapter.close()
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
        return (self.settings.retries + 1) * (n_buckets + 4) * self.settings.timeout_s + 30

    def _engine(self, url: str) -> EngineState:
        for e in self.engines:
            if e.url == normalize_url(url) or e.client.base_url == normalize_url(url):
                return e
        raise ValueError(f"engine_url {url!r}: not one of the connected engines")

    def _mark(self, event: str, bucket: int = -1) -> None:
        if self.trace is not None:
            self.trace.append((event, bucket, time.perf_counter()))

    def _plan(self, named_tensors: NamedTensors,
              engines: list[EngineState]) -> tuple[list[TensorSpec], list[TensorSpec], Payload]:
        """Validate ``named_tensors`` against the live ``engines`` and plan them: each tensor's spec as
        given and as it travels (floating tensors in the engines' dtype), and the transport's payload."""
        named = list(named_tensors)
        specs = check_tensors(named)
        for e in engines:
            if e.alive:
                e.validate(specs)
        sent = push_specs(specs, [e.params for e in engines], self.settings.engine_dtype)
        return specs, sent, self._transport.plan(named, sent)

    async def _connect(self, urls: list[str], gpus: list[int] | None) -> None:
        s = self.settings
        self.engines = [EngineState.of(u, s) for u in urls]
        await asyncio.gather(*(fetch_params(e, s.timeout_s) for e in self.engines))
        if gpus is None:  # each engine joins the group with one rank per GPU (SGLang: rank_offset + tp_rank)
            gpus = await asyncio.gather(*(gpu_count(e) for e in self.engines))
        for e, g in zip(self.engines, gpus):
            e.gpus = g
        await self._transport.connect(self.engines)

    async def _revive(self, specs: list[TensorSpec]) -> int:
        """Engines marked dead that answer /health again rejoin now (their parameter list fetched anew
        and the push validated against it), so they get this push with the others; how many came back."""
        dead = [e for e in self.engines if not e.alive]
        if not dead:
            return 0
        healthy = await asyncio.gather(*(e.client.health(timeout=min(2.0, self.settings.timeout_s)) for e in dead))
        back = [e for e, ok in zip(dead, healthy) if ok]
        for e in back:
            await fetch_params(e, self.settings.timeout_s)
            e.validate(specs)
            logger.info("engine %s answers again; it rejoins with this push", e.url)
            e.alive = True
        return len(back)

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
            return {"weight_sync/time_s": pause_to_continue, "weight_sync/transfer_s": tl.send_s,
                    "weight_sync/gib_per_s": payload.nbytes / 2 ** 30 / max(pause_to_continue - tl.check_s, 1e-9),
                    "weight_sync/pause_s": tl.paused - tl.pause, "weight_sync/continue_s": tl.continued - tl.checked,
                    "weight_sync/check_s": tl.check_s, "weight_sync/connect_s": connect_s,
                    "weight_sync/pack_first_s": tl.pause - t0 - connect_s, "weight_sync/total_s": tl.continued - t0,
                    "weight_sync/bytes": float(payload.nbytes), "weight_sync/num_buckets": float(len(payload.buckets)),
                    "weight_sync/held_tensors": float(len(payload.held)), "weight_sync/num_tensors": float(len(specs)),
                    "weight_sync/engines": float(len(members)), "weight_sync/attempts": float(attempt + 1),
                    "weight_sync/version": float(version), "weight_sync/revived": float(revived)}
        raise RuntimeError(f"push v{version}: failed after {s.retries + 1} attempts; live engines are left paused "
                           f"(their weights may be partly updated); engines: {self.engine_status()}") from last_error

    async def _sequence(self, members: list[EngineState], send: Callable[[Resume | None], Awaitable[float | None]],
                        named: Named | None = None, specs: list[TensorSpec] | None = None, *, generating: bool = True,
                        early_continue: bool = False, end_on_error: bool = True) -> _Timeline:
        """SGLang's update sequence (the module docstring's 2-5) on ``members``, the one copy of it;
        ``check_equal`` of ``named`` if set. No session unless ``Transport.sessions``; no pause nor continue unless
        ``generating``. ``early_continue``: ``send`` gets a ``resume`` that starts the end and the
        continue at once. ``end_on_error``: a failed send ends the session here (a push: ``_after_failure``)."""
        s, tr = self.settings, self._transport
        resumed = False

        def resume() -> "asyncio.Future[None]":
            nonlocal resumed
            resumed = True
            self._mark("continue")
            return asyncio.ensure_future(end_session(members, s.timeout_s, then_continue=True, session=tr.sessions))
        t_pause = time.perf_counter()  # generation stops from here
        try:
            if generating:
                self._mark("pause")
                await call_all(members, lambda c: c.pause_generation(s.pause_mode), "pause_generation")
                self._mark("paused")
            t_paused = time.perf_counter()
            await begin_session(members, s.timeout_s, session=tr.sessions)
            try:
                send_s = await send(resume if early_continue else None)
            except BaseException:
                if end_on_error and not resumed:
                    await end_session(members, s.timeout_s, session=tr.sessions)
                raise
            if not resumed:
                await end_session(members, s.timeout_s, session=tr.sessions)
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
        t = self.settings.timeout_s
        healthy = await asyncio.gather(*(e.client.health(timeout=min(5.0, t)) for e in members))
        answering = [e for e, ok in zip(members, healthy) if ok]
        if self._transport.sessions:  # best effort: "no session open" is fine too
            await asyncio.gather(*(e.client.end_weight_update(min(10.0, t)) for e in answering), return_exceptions=True)
        for e, ok in zip(members, healthy):
            if e.url in err.failed:
                e.errors.append(err.failed[e.url])
            if not ok:
                logger.warning("engine %s is not answering; it is left out until resync()", e.url)
                e.alive, e.version = False, None
        await self._transport.after_failure(members, {e.url for e in answering})

    async def _resync(self, e: EngineState, named_tensors: NamedTensors | None,
                      version: int | None) -> dict[str, float]:
        if not await e.client.health(timeout=min(10.0, self.settings.timeout_s)):
            raise RuntimeError(f"resync: engine {e.url} is not answering /health")
        await fetch_params(e, self.settings.timeout_s)  # a restarted engine may report a different list
        e.alive, e.version = True, None
        if named_tensors is None:
            return {}
        _, sent, payload = self._plan(named_tensors, [e])
        t0 = time.perf_counter()
        await self._transport.prepare([e], payload, keep=False)  # distributed: a group of the trainer and e only
        await self._sequence([e], functools.partial(self._transport.send, [e], payload, version, None),
                             payload.named, sent)
        e.version = version
        return {"weight_sync/resync_s": time.perf_counter() - t0}

    async def _close(self) -> None:
        alive = [e for e in self.engines if e.alive]
        if self._transport.holds_weights and self.version is not None:
            try:  # inside a session, the engines drop the trainer's tensors they hold; best effort (closing)
                await self._sequence(alive, lambda _: self._transport.release(alive), generating=False)
            except Exception as e:
                logger.warning("close: engines may still hold the trainer's tensors: %s", e)
        await self._transport.close({e.url for e in alive})
        for e in self.engines:
            await e.client.close()
        await asyncio.sleep(0.05)  # aiohttp closes transports on the next loop iterations

