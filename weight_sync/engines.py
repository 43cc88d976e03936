"""What the sender knows about each engine, and the requests it makes to all engines at once.

The parameter list an engine reports (``/weights_info``; else the names of ``/weights_checksum``;
SGLang has neither) is what a push is validated against before anything is sent, and
``/weights_checksum`` is how ``check_equal`` compares every engine's weights with the trainer's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from rollout_manager.engine_client import EngineClient, EngineError
from weight_sync.interfaces import TensorSpec
from weight_sync.link import PushFailed

logger = logging.getLogger(__name__)


@dataclass
class EngineState:
    """What the sender knows about one engine."""

    url: str
    gpus: int
    client: EngineClient
    params: dict[str, TensorSpec | None] | None = None  # reported at connect; None: cannot list them
    tied: dict[str, str] = field(default_factory=dict)  # name -> the name whose storage it shares
    complete: bool = False  # params lists every parameter with its spec (so all must be pushed)
    alive: bool = True
    version: int | None = None  # last version this engine fully received
    errors: list[str] = field(default_factory=list)


async def fetch_params(e: EngineState, timeout_s: float) -> None:
    """Ask the engine for its parameter list once: ``/weights_info`` (names, shapes, dtypes,
    ties); else the names of ``/weights_checksum``; else (e.g. SGLang) nothing to validate."""
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


async def check_equal(members: list[EngineState], named, timeout_s: float) -> float:
    """Compare every engine's per-tensor checksums with the trainer's (RuntimeError on a mismatch)."""
    from weight_sync.buckets import tensor_checksum

    t = time.perf_counter()
    loop = asyncio.get_running_loop()
    mine = await loop.run_in_executor(None, lambda: {n: tensor_checksum(x) for n, x in named})
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
