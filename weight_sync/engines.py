"""What the sender knows about each engine, and the requests it makes to all engines at once.

The parameter list an engine reports (``/weights_info``; else the names of ``/weights_checksum``;
SGLang has neither) is what a push is validated against before anything is sent.
``check_equal`` compares every engine's weights with the trainer's after a push, with what the
engine offers: ``/weights_checksum`` (the embedded engine: every byte of every tensor), else
SGLang's ``/get_weights_by_name`` (a read-back of each tensor's leading rows, see
:func:`readback_rows`). An engine with neither is refused at connect when ``check_equal`` is on,
not at the first push, where it would fail after the engines were paused. ``EngineMemory`` hands
the engines' GPU memory to a colocated trainer and back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

from sglang_protocol.client import EngineClient, EngineError, normalize_url
from weight_sync.interfaces import Named, TensorSpec, WeightSyncSettings
from weight_sync.link import PushFailed
from weight_sync.plan import check_against_engine

logger = logging.getLogger(__name__)
T = TypeVar("T")
#: A call made of every engine: ``call(client)``.
Call = Callable[[EngineClient], Awaitable[Any]]


@dataclass
class EngineState:
    """What the sender knows about one engine."""

    url: str
    gpus: int
    client: EngineClient
    check_equal: bool = False  # --check-weight-update-equal: the engine must offer a way to compare
    check: str | None = None  # how check_equal reads it: "checksum" (/weights_checksum) or "readback" (SGLang)
    params: dict[str, TensorSpec | None] | None = None  # reported at connect; None: cannot list them
    tied: dict[str, str] = field(default_factory=dict)  # name -> the name whose storage it shares
    complete: bool = False  # params lists every parameter with its spec (so all must be pushed)
    alive: bool = True
    version: int | None = None  # last version this engine fully received
    errors: list[str] = field(default_factory=list)

    @staticmethod
    def of(url: str, settings: WeightSyncSettings) -> "EngineState":
        """A new engine at ``url`` (one GPU until its count is known), with a client of ``settings``."""
        client = EngineClient(url, timeout=settings.timeout_s, api_key=settings.api_key,
                              admin_api_key=settings.admin_api_key)
        return EngineState(normalize_url(url), 1, client, check_equal=settings.check_equal)

    def validate(self, specs: list[TensorSpec]) -> None:
        """ValueError naming the first tensor of a push (``specs``) this engine cannot take (nothing
        to check where it does not list its parameters)."""
        if self.params is not None:
            check_against_engine(specs, self.params, self.url, self.tied, self.complete)


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
        e.check = "checksum"  # an engine that lists its parameters serves /weights_checksum (the embedded one)
        return
    except EngineError as err:
        if err.status != 404:
            raise RuntimeError(f"engine {e.url}: cannot fetch its parameter list: {err}") from err
    try:
        sums = await e.client.request("GET", "/weights_checksum", timeout=timeout_s)
        e.params = {n: None for n in sums}  # names only; tied names are not told apart
        e.check = "checksum"
        logger.warning("engine %s has no /weights_info: pushes are checked against its names only", e.url)
    except EngineError as err:
        if err.status != 404:
            raise RuntimeError(f"engine {e.url}: cannot fetch its parameter list: {err}") from err
        if e.check_equal:
            await _probe_readback(e, timeout_s)
        else:
            logger.info("engine %s lists no parameters (no /weights_info or /weights_checksum: an SGLang server); "
                        "its own loaders check what a push names (--check-weight-update-equal reads it back)", e.url)


# The first tensor every model SGLang can read back names this way (llama, qwen, mistral, ...).
_PROBE = "model.embed_tokens.weight"
# At most this many elements of one tensor are read back over JSON (its leading rows): all of every
# tensor of a small model, a row prefix of each large one.
READBACK_ELEMENTS = 1 << 18


async def _probe_readback(e: EngineState, timeout_s: float) -> None:
    """``check_equal`` on an engine without ``/weights_checksum`` (SGLang): it must read tensors back
    with ``/get_weights_by_name``; else ValueError naming the flag (at connect, before any push)."""
    try:
        rows = await e.client.get_weights_by_name(_PROBE, 1, timeout=timeout_s)
    except EngineError as err:
        raise ValueError(
            f"--check-weight-update-equal: engine {e.url} has no /weights_checksum and cannot read its weights "
            f"back (/get_weights_by_name {_PROBE!r}: {err}; SGLang implements that route for llama-family models "
            "only): drop the flag") from None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"--check-weight-update-equal: engine {e.url}: /get_weights_by_name {_PROBE!r} answered "
                         f"{str(rows)[:200]!r}, not the tensor's rows: drop the flag")
    e.check = "readback"


async def call_all(members: list[EngineState], call: Call, what: str) -> list[Any]:
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


async def gpu_count(e: EngineState) -> int:
    """Engine ``e``'s GPUs from its ``/server_info``; RuntimeError naming it when that cannot be read."""
    try:
        return await e.client.gpu_count()
    except Exception as err:
        raise RuntimeError(f"engine {e.url}: cannot read /server_info for its GPU count (pass engine_gpus): "
                           f"{err}") from err


_SESSION_OPEN = "a weight-update session is already open"  # SGLang's refusal of a second begin


async def begin_session(members: list[EngineState], timeout_s: float, session: bool = True) -> None:
    """``/begin_weight_update`` on every member (none unless ``session``; SGLang >= 0.5.22 loads
    weights only inside that session, an older server answers 404: none needed). One that refuses
    because a session is already open (a trainer before this one died inside a push: engines given by
    --engine-urls outlive it) gets that session closed and is asked once more; PushFailed naming
    each engine that still fails."""
    if not session:
        return
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


async def end_session(members: list[EngineState], timeout_s: float, then_continue: bool = False,
                      session: bool = True) -> None:
    """``/end_weight_update`` on every member (a 404 from an older server is fine; none unless
    ``session``), then ``/continue_generation`` if asked; PushFailed naming each engine that failed."""
    if session:
        await call_all(members, lambda c: c.end_weight_update(timeout_s), "end_weight_update")
    if then_continue:
        await call_all(members, lambda c: c.continue_generation(), "continue_generation")


async def check_equal(members: list[EngineState], named: Named, timeout_s: float,
                      sent: list[TensorSpec] | None = None) -> float:
    """Compare every engine's weights with the trainer's ``named`` (RuntimeError naming the tensor and
    the engine on a mismatch); ``sent``: the specs the tensors were pushed with (a tensor cast at the
    push is compared as cast). Engines with ``/weights_checksum`` compare per-tensor checksums of
    every byte; SGLang servers read each tensor back (:func:`readback_rows`). Returns the seconds."""
    t = time.perf_counter()
    dtypes = {s.name: s.dtype for s in sent or []}
    by_checksum = [e for e in members if e.check != "readback"]
    if by_checksum:
        await _compare_checksums(by_checksum, named, dtypes, timeout_s)
    for e in members:
        if e.check == "readback":
            await _compare_readback(e, named, dtypes, timeout_s)
    return time.perf_counter() - t


async def _compare_checksums(members: list[EngineState], named: Named, dtypes: dict[str, str],
                             timeout_s: float) -> None:
    from sglang_protocol.buckets import parse_dtype, tensor_checksum

    loop = asyncio.get_running_loop()
    casts = {n: parse_dtype(d) for n, d in dtypes.items()}
    mine = await loop.run_in_executor(None, lambda: {n: tensor_checksum(x, casts.get(n)) for n, x in named})
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


def readback_rows(t: "torch.Tensor") -> int:
    """How many leading rows of ``t`` a read-back compares: all of them while the tensor holds at
    most ``READBACK_ELEMENTS`` elements, else as many whole rows as fit (at least one)."""
    if t.dim() == 0:
        return 1
    row = max(1, t[0].numel()) if t.dim() > 1 else 1
    return max(1, min(t.shape[0], READBACK_ELEMENTS // row))


async def _compare_readback(e: EngineState, named: Named, dtypes: dict[str, str], timeout_s: float) -> None:
    """SGLang's ``/get_weights_by_name`` for every pushed tensor, compared exactly with the
    trainer's (cast as pushed, then to float32 as SGLang answers: exact for fp32/bf16/fp16).

    What SGLang returns: the leading rows of the tensor as TP rank 0 holds it. So the engine may
    answer more rows than the trainer has (a vocabulary padded to a multiple of 64 or 128: only
    the trainer's rows are compared, the padding is SGLang's) and, with TP > 1, fewer (rank 0's
    shard of a column-parallel weight is the tensor's leading rows: those are compared). Each
    comparison runs in a thread while the next tensor is read."""
    # One read at a time: SGLang 0.5.15's tokenizer manager queues control calls in a FanOutCommunicator
    # whose hand-over races when a third call arrives as one ends (an empty AssertionError, answered
    # 400 {"message": ""}: seen on the GPU tier with 8 reads in flight)
    sem = asyncio.Semaphore(1)

    async def one(name: str, t: "torch.Tensor") -> None:
        rows = readback_rows(t)
        async with sem:
            try:
                got = await e.client.get_weights_by_name(name, rows, timeout=timeout_s)
            except Exception as err:  # noqa: BLE001 - named below
                raise RuntimeError(f"check_weight_update_equal: engine {e.url} cannot read back {name!r}: {err}") \
                    from err
        loop = asyncio.get_running_loop()
        why = await loop.run_in_executor(None, _readback_mismatch, t, dtypes.get(name), got, rows, e.gpus > 1)
        if why:
            raise RuntimeError(f"check_weight_update_equal: weight {name!r} differs on engine {e.url}: {why}")

    await asyncio.gather(*(one(n, t) for n, t in named))


def _readback_mismatch(t: "torch.Tensor", dtype: str | None, got: Any, rows: int, sharded: bool) -> str | None:
    """Why the engine's read-back ``got`` (nested lists) differs from the trainer's ``t``; None if equal."""
    import torch

    from sglang_protocol.buckets import parse_dtype

    want = t.detach()
    if dtype is not None:
        want = want.to(parse_dtype(dtype))
    want = want.to("cpu", torch.float32).reshape(t.shape if t.dim() else (1,))[:rows]
    try:
        have = torch.tensor(got, dtype=torch.float32)
    except (TypeError, ValueError) as err:
        return f"the engine answered something other than rows of numbers ({err})"
    if have.dim() != want.dim() or have.shape[1:] != want.shape[1:]:
        return f"the engine's rows have shape {tuple(have.shape)}, the trainer's {tuple(want.shape)}"
    n = min(have.shape[0], want.shape[0])
    if n < want.shape[0] and not sharded:
        return f"the engine has {have.shape[0]} rows, the trainer {want.shape[0]}"
    diff = (have[:n] != want[:n])
    if diff.any():
        first = tuple(int(i) for i in diff.nonzero()[0])
        return (f"{int(diff.sum())} of {diff.numel()} elements read back differ, first at {first}: engine "
                f"{float(have[first])!r} != trainer {float(want[first])!r}")
    return None


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

    ``restarts()``: per engine URL, how often it was started again (the fleet's count). An engine
    restarted after ``release`` came back holding all its memory and serving: ``resume`` does not
    resume memory it never released (SGLang's scheduler fails on a tag it does not hold released).
    """

    def __init__(self, urls: list[str], settings: WeightSyncSettings, tags: tuple[str, ...] = ("kv_cache",),
                 restarts: Callable[[], dict[str, int]] | None = None):
        self.urls, self.settings, self.tags = list(urls), settings, list(tags)
        self._restarts = restarts
        self._restarts_at_release: dict[str, int] = {}
        self._paused: list[str] = []  # engines paused by release(): resume() continues them
        # engines holding released memory: resume() takes back exactly those (SGLang's resume of a
        # tag it did not release fails in its scheduler)
        self._released: list[str] = []
        self._unsupported: set[str] = set()

    def release(self) -> float:
        """Pause every engine and release its ``tags``; returns the seconds it took."""
        t = time.perf_counter()
        if self._restarts is not None:
            self._restarts_at_release = self._restarts()
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
        if self._restarts is not None and released:
            now = self._restarts()
            restarted = [u for u in released if now.get(u, 0) != self._restarts_at_release.get(u, 0)]
            for u in restarted:
                logger.warning("engine %s was restarted while its memory was released: it holds its memory again, "
                               "nothing to resume", u)
            released = [u for u in released if u not in restarted]
        self._run(self._each(released, "resume_memory_occupation",
                             lambda c: c.resume_memory_occupation(self.tags, self._timeout)))
        paused, self._paused = self._paused, []
        self._run(self._each(paused, "continue_generation", lambda c: c.continue_generation()))
        return time.perf_counter() - t

    @property
    def _timeout(self) -> float:
        return self.settings.timeout_s

    @staticmethod
    def _run(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run(coro)

    async def _each(self, urls: list[str], what: str, call: Call) -> list[str]:
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
