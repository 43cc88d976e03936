"""What the sender knows about each engine, and the requests it makes to all engines at once.

The parameter list an engine reports (``/weights_info``; else the names of ``/weights_checksum``;
SGLang has neither) is what a push is validated against before anything is sent, and
``/weights_checksum`` is how ``check_equal`` compares every engine's weights with the trainer's.
An engine without ``/weights_checksum`` (SGLang) is refused at connect when ``check_equal`` is on,
not at the first push, where it would fail after the engines were paused. ``EngineMemory`` hands
the engines' GPU memory to a colocated trainer and back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from sglang_protocol.client import EngineClient, EngineError
from weight_sync.interfaces import TensorSpec, WeightSyncSettings
from weight_sync.link import PushFailed

logger = logging.getLogger(__name__)


@dataclass
class EngineState:
    """What the sender knows about one engine."""

    url: str
    gpus: int
    client: EngineClient
    check_equal: bool = False  # --check-weight-update-equal: the engine must serve /weights_checksum
    params: dict[str, TensorSpec | None] | None = None  # reported at connect; None: cannot list them
    tied: dict[str, str] = field(default_factory=dict)  # name -> the name whose storage it shares
    complete: bool = False  # params lists every parameter with its spec (so all must be pushed)
    alive: bool = True
    version: int | None = None  # last version this engine fully received
    errors: list[str] = field(default_factory=list)


async def fetch_params(e: EngineState, timeout_s: float) -> None:
    """Ask the engine for its parameter list once: ``/weights_info`` (names, shapes, dtypes,
    ties; the embedded engine, which serves ``/weights_checksum`` too); else the names of
    ``/weights_checksum``; else (e.g. SGLang) nothing to validate. ValueError naming
    ``--check-weight-update-equal`` if ``e.check_equal`` and the engine has no ``/weights_checksum``."""
    e.params, e.tied, e.complete = None, {}, False
    try:
        info = await e.client.request("GET", "/weights_info", timeout=timeout_s)
        e.params = {p["name"]: TensorSpec(p["name"], tuple(p["shape"]), str(p["dtype"]).removeprefix("torch."))
                    for p in info["params"]}
        e.tied = {p["name"]: p["tied_to"] for p in info["params"] if p.get("tied_to")}
        e.complete = True
        return
    except EngineError as err:
        if err.status != 404:
            raise RuntimeError(f"engine {e.url}: cannot fetch its parameter list: {err}") from err
    try:
        sums = await e.client.request("GET", "/weights_checksum", timeout=timeout_s)
        e.params = {n: None for n in sums}  # names only; tied names are not told apart
        logger.warning("engine %s has no /weights_info: pushes are checked against its names only", e.url)
    except EngineError as err:
        if err.status != 404:
            raise RuntimeError(f"engine {e.url}: cannot fetch its parameter list: {err}") from err
        if e.check_equal:
            raise ValueError(f"--check-weight-update-equal: engine {e.url} has no /weights_checksum to compare "
                             "with (SGLang servers have none; the embedded engine has it): drop the flag") from None
        logger.warning("engine %s cannot list its parameters (%s); pushes to it are not validated", e.url, err)


async def call_all(members: list[EngineState], call, what: str) -> list:
    """``call(client)`` on every member concurrently; PushFailed naming each engine that failed."""
    outs = await asyncio.gather(*(call(e.client) for e in members), return_exceptions=True)
    failed = {}
    for e, out in zip(members, outs):
        if isinstance(out, BaseException):
            failed[e.url] = f"{what}: {type(out).__name__}: {out}"
        elif isinstance(out, dict) and out.get("success") is False:
            failed[e.url] = f"{what}: {out.get('message')}"
    if failed:
        raise PushFailed(failed)
    return outs


async def check_equal(members: list[EngineState], named, timeout_s: float,
                      sent: list[TensorSpec] | None = None) -> float:
    """Compare every engine's per-tensor checksums with the trainer's (RuntimeError on a mismatch);
    ``sent``: the specs the tensors were pushed with (a tensor cast at the push is compared as cast)."""
    from sglang_protocol.buckets import parse_dtype, tensor_checksum

    t = time.perf_counter()
    loop = asyncio.get_running_loop()
    dtypes = {s.name: parse_dtype(s.dtype) for s in sent or []}
    mine = await loop.run_in_executor(None, lambda: {n: tensor_checksum(x, dtypes.get(n)) for n, x in named})
    theirs = await call_all(members, lambda c: c.request("GET", "/weights_checksum",
                                                          timeout=timeout_s), "weights_checksum")
    for e, sums in zip(members, theirs):
        sums = sums.get("checksums", sums) if isinstance(sums, dict) else sums
        for n, want in mine.items():
            if n not in sums:
                raise RuntimeError(f"check_weight_update_equal: engine {e.url} reports no checksum for {n!r}")
            if sums[n] != want:
                raise RuntimeError(f"check_weight_update_equal: weight {n!r} differs on engine {e.url}: "
                                   f"engine {sums[n]!r} != trainer {want!r}")
    return time.perf_counter() - t


class EngineMemory:
    """Colocated mode (``--colocate``): the engines' GPU memory handed to the trainer for a
    training step and back, with SGLang's ``/release_memory_occupation`` and
    ``/resume_memory_occupation``.

    ``release()`` pauses every engine (``abort``: SGLang releases memory only on an idle engine, and
    a paused one counts as idle) and releases ``tags``; ``resume()`` takes back what was released
    and continues generation (after a push the engines continued already: the second call is a
    no-op; before the first step nothing else continues them). Only the KV cache is released by
    default: the weights stay in place, so a push lands in them while the trainer still holds its
    training memory. An engine without these routes (HTTP 404) is left as it is, with a warning.
    Runs in a caller without an event loop (the launcher's driver). RuntimeError names the engine
    and the call that failed.
    """

    def __init__(self, urls: list[str], settings: WeightSyncSettings, tags: tuple[str, ...] = ("kv_cache",)):
        self.urls, self.settings, self.tags = list(urls), settings, list(tags)
        self._paused: list[str] = []  # engines paused by release(): resume() continues them
        # engines holding released memory: resume() takes back exactly those (SGLang's resume of a
        # tag it did not release fails in its scheduler)
        self._released: list[str] = []
        self._unsupported: set[str] = set()

    def release(self) -> float:
        """Pause every engine and release its ``tags``; returns the seconds it took."""
        t = time.perf_counter()
        urls = [u for u in self.urls if u not in self._paused]
        self._paused += self._run(self._each(urls, "pause_generation", lambda c: c.pause_generation("abort")))
        urls = [u for u in urls if u in self._paused and u not in self._unsupported]
        self._released += self._run(self._each(urls, "release_memory_occupation",
                                               lambda c: c.release_memory_occupation(self.tags, self._timeout)))
        return time.perf_counter() - t

    def resume(self) -> float:
        """Take back what ``release`` released and continue generation; returns the seconds it took."""
        t = time.perf_counter()
        released, self._released = self._released, []
        self._run(self._each(released, "resume_memory_occupation",
                             lambda c: c.resume_memory_occupation(self.tags, self._timeout)))
        paused, self._paused = self._paused, []
        self._run(self._each(paused, "continue_generation", lambda c: c.continue_generation()))
        return time.perf_counter() - t

    @property
    def _timeout(self) -> float:
        return self.settings.timeout_s

    @staticmethod
    def _run(coro):
        return asyncio.run(coro)

    async def _each(self, urls: list[str], what: str, call) -> list[str]:
        """``call(client)`` on every engine in ``urls`` at once; the urls it succeeded on."""
        s = self.settings

        async def one(url: str):
            async with EngineClient(url, timeout=s.timeout_s, api_key=s.api_key, admin_api_key=s.admin_api_key) as c:
                return await call(c)
        outs = await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)
        done, failed = [], {}
        for url, out in zip(urls, outs):
            if isinstance(out, EngineError) and out.status == 404:
                logger.warning("engine %s has no /%s: its memory is not handed over to the trainer", url, what)
                self._unsupported.add(url)
            elif isinstance(out, BaseException):
                failed[url] = f"{type(out).__name__}: {out}"
            elif isinstance(out, dict) and out.get("success") is False:
                failed[url] = str(out.get("message"))
            else:
                done.append(url)
        if failed:  # what did happen is recorded, so that resume() undoes it
            if what == "release_memory_occupation":
                self._released += done
            elif what == "pause_generation":
                self._paused += done
            raise RuntimeError(f"--colocate: {what} failed on " + "; ".join(f"{u}: {m}" for u, m in failed.items()))
        return done
