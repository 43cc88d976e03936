"""One weight-update group between trainer rank 0 and a set of engines, and sending over it.

``open_link`` joins the group the way SGLang does: every engine gets POST
``/init_weights_update_group`` (its ``rank_offset`` = 1 + GPUs of the engines before it) while
rank 0 hosts the TCP rendezvous and joins in a thread; ``send_bucket`` POSTs a bucket's metadata
to every engine and broadcasts the bucket from rank 0 while those requests are in flight (each
engine receives inside its handler). Every step is bounded by ``timeout_s``; a failure raises
``PushFailed`` naming each engine (or ``trainer``) that failed.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from rollout_manager.engine_client import EngineClient
from weight_sync._loop import SerialThread, free_port, in_thread
from weight_sync.buckets import flatten_bucket
from weight_sync.interfaces import WeightSyncSettings
from weight_sync.plan import Bucket
from weight_sync.process_group import WeightUpdateGroup, init_weight_update_group

logger = logging.getLogger(__name__)
TRAINER = "trainer"


class PushFailed(RuntimeError):
    """A step of a push failed on some engines; ``failed`` maps engine url (or 'trainer') -> reason."""

    def __init__(self, failed: dict[str, str]):
        self.failed = failed
        super().__init__("; ".join(f"{k}: {v}" for k, v in failed.items()))


@dataclass
class Link:
    """A joined weight-update group: its name, rank 0's handle and the member engines, in rank order."""

    name: str
    group: WeightUpdateGroup
    members: list[tuple[str, int, EngineClient]]  # (url, gpus, client)
    device: torch.device
    flattened: bool
    broken: bool = False  # rank 0's side was aborted after a failure
    joined: bool = False  # a collective has run (NCCL builds its communicator at the first one)
    # rank 0's collectives of this group, issued in order from one thread
    worker: SerialThread = field(default_factory=lambda: SerialThread("weight-sync-broadcast"))
    # CPU only: two reused packing buffers (fresh multi-MB allocations come back from the OS as new
    # pages, and faulting them in cost more than the copy itself). Bucket k packs into slot k % 2;
    # gloo transfers are complete when send_bucket returns, so slot k % 2 is free again at k + 2.
    _staging: list = field(default_factory=lambda: [None, None])
    _packs: int = 0

    @property
    def urls(self) -> list[str]:
        return [m[0] for m in self.members]

    def pack(self, named: list[tuple[str, torch.Tensor]], bucket: Bucket, device: torch.device) -> list[torch.Tensor]:
        """The tensors to broadcast for ``bucket``: one flat tensor, or each tensor (contiguous)."""
        with torch.no_grad():
            ts = [named[i][1].detach().to(device, non_blocking=True) for i in bucket.indices]
            if self.flattened:
                if len(ts) == 1 and ts[0].is_contiguous():
                    return [ts[0].reshape(-1)]  # [numel], a view: a lone tensor needs no packing copy
                if device.type == "cpu":
                    return [self._pack_cpu(ts, bucket.nbytes)]
                return [flatten_bucket(ts)]  # [sum of numels], the bucket's dtype
            return [t.contiguous() for t in ts]


    def _pack_cpu(self, ts: list[torch.Tensor], nbytes: int) -> torch.Tensor:
        slot = self._packs % 2
        self._packs += 1
        buf = self._staging[slot]
        if buf is None or buf.numel() < nbytes:
            buf = self._staging[slot] = torch.empty(nbytes, dtype=torch.uint8)  # [bytes]
        flat = buf[:nbytes].view(ts[0].dtype)  # [sum of numels]
        torch.cat([t.reshape(-1) for t in ts], out=flat)
        return flat


async def open_link(settings: WeightSyncSettings, members: list[tuple[str, int, EngineClient]], name: str) -> Link:
    """Join trainer rank 0 and ``members`` into the group ``name``; PushFailed if any fails."""
    s = settings
    backend = s.resolved_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    port = s.master_port or free_port(s.master_address)
    world = 1 + sum(g for _, g, _ in members)
    offsets, nxt = [], 1
    for _, g, _ in members:
        offsets.append(nxt)
        nxt += g
    join = in_thread(init_weight_update_group, backend, s.master_address, port, 0, world, name, s.timeout_s,
                     device if backend == "nccl" else None)
    posts = [c.init_weights_update_group(s.master_address, port, off, world, name, backend, timeout=s.timeout_s)
             for (_, _, c), off in zip(members, offsets)]
    outs = await asyncio.gather(asyncio.wait_for(join, s.timeout_s + 5), *posts, return_exceptions=True)
    failed = _failures([TRAINER] + [u for u, _, _ in members], outs, "init_weights_update_group")
    if failed:
        joined = [m for m, out in zip(members, outs[1:]) if m[0] not in failed]
        await _destroy_on_engines(joined, name, s.timeout_s)
        if not isinstance(outs[0], BaseException):
            outs[0].destroy()
        raise PushFailed(failed)
    logger.info("weight-update group %s joined: %s backend, world size %d, port %d", name, backend, world, port)
    return Link(name, outs[0], list(members), device, s.load_format == "flattened_bucket")


async def send_bucket(link: Link, bucket: Bucket, packed: list[torch.Tensor], settings: WeightSyncSettings,
                      weight_version: str | None, flush_cache: bool,
                      after_issue: Callable[[], None] | None = None) -> "torch.cuda.Event | None":
    """POST the bucket's metadata to every member and broadcast ``packed`` from rank 0 meanwhile.

    gloo: returns when the bucket has arrived. nccl: returns once every engine has answered, i.e.
    has queued its receive on its GPU (its handler returns without waiting for the transfer, as
    SGLang's does); the transfer itself may still run, and the returned CUDA event marks its end
    on rank 0. Queued NCCL operations of one group run in queue order on both sides, so the
    next bucket's POST can go out now: HTTP round trips overlap with transfers. ``after_issue()``
    runs once the requests are out and the broadcast is issued, while the answers are awaited.
    """
    s = settings
    fmt = "flattened_bucket" if link.flattened else None
    posts = [asyncio.ensure_future(c.update_weights_from_distributed(
        **bucket.payload(), group_name=link.name, weight_version=weight_version, flush_cache=flush_cache,
        load_format=fmt, timeout=s.timeout_s)) for _, _, c in link.members]
    if link.device.type == "cuda" and link.joined:
        # NCCL only queues the broadcast on the GPU: issued on this loop (a hop to the worker
        # thread costs a thread wake-up per bucket), once the requests are written (one turn of
        # the loop), so that the engines start on them meanwhile.
        await asyncio.sleep(0)
        bcast = _now(_broadcast, link.group, packed, link.device)
    else:  # gloo blocks until the bucket is across; NCCL's first collective builds the communicator
        bcast = link.worker.submit(_broadcast, link.group, packed, link.device)
    error = None
    if after_issue is not None:
        try:
            after_issue()
        except Exception as e:  # raised once this bucket's requests are settled
            error = e
    outs = await _gather_bounded([asyncio.wait_for(bcast, s.timeout_s), *posts], s.timeout_s,
                                 on_failure=lambda: abort_link(link))
    if error is not None:
        raise error
    failed = _failures([TRAINER] + link.urls, outs, "update_weights_from_distributed")
    if failed:
        raise PushFailed(failed)
    link.joined = True
    return outs[0]


async def wait_transfer(link: Link, event: "torch.cuda.Event | None", timeout_s: float) -> None:
    """Wait (bounded) until the transfer that ``event`` marks is done on rank 0; PushFailed if not.

    Polls the event from the loop (a transfer takes a few ms; a thread to block in
    ``synchronize`` would add its wake-up to each wait)."""
    if event is None:
        return
    deadline = time.monotonic() + timeout_s
    try:
        while not event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not done after {timeout_s} s")
            await asyncio.sleep(0)
    except Exception as e:
        await abort_link(link)
        raise PushFailed({TRAINER: f"broadcast did not complete: {type(e).__name__}: {e}"}) from e


async def close_link(link: Link, timeout_s: float, urls_alive: set[str] | None = None) -> None:
    """Leave the group on the engines (those in ``urls_alive``, default all) and on rank 0."""
    members = [m for m in link.members if urls_alive is None or m[0] in urls_alive]

    link.worker.stop()

    async def mine() -> None:
        if link.broken:
            return
        try:
            await asyncio.wait_for(in_thread(link.group.destroy), timeout_s)
        except Exception as e:  # the group may be broken by a dead peer; it is dropped either way
            logger.warning("destroying weight-update group %s on the trainer: %s: %s", link.name, type(e).__name__, e)

    # Both sides at once: NCCL's communicator shutdown waits for its peers (measured: an engine's
    # destroy blocks until rank 0 destroys too), so sequential teardown would deadlock.
    await asyncio.gather(_destroy_on_engines(members, link.name, timeout_s), mine())


async def _gather_bounded(aws: list, timeout_s: float, on_failure=None, grace_s: float = 5.0) -> list:
    """Like ``gather(return_exceptions=True)``, but once one step has failed, ``on_failure()`` is
    awaited and the others get only ``grace_s`` more (peers of a broken collective may otherwise
    wait until their own timeout)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, timeout=timeout_s + grace_s,
                                           return_when=asyncio.FIRST_EXCEPTION)
        if not done or any(t.exception() is not None for t in done):
            if pending:
                if on_failure is not None:
                    await on_failure()
                await asyncio.wait(pending, timeout=min(grace_s, timeout_s))
            break
    late = [t for t in tasks if not t.done()]
    for t in late:
        t.cancel()
    await asyncio.gather(*late, return_exceptions=True)  # let the cancellations land
    outs = []
    for t in tasks:
        if t.cancelled():
            outs.append(TimeoutError("gave up after another step of the same bucket failed"))
        else:
            outs.append(t.exception() or t.result())
    return outs


async def abort_link(link: Link) -> None:
    """Tear down rank 0's side of a failed group at once. Dropping the last reference to the gloo
    process group closes its connections, which wakes engines still blocked in a receive of this
    bucket (their requests then fail now instead of at their own, possibly long, timeout);
    ``ProcessGroup.abort()`` does not do that for gloo (measured with torch 2.13)."""
    link.broken = True
    link.worker.stop()
    ref, link.group.pg = [link.group.pg], None  # type: ignore[assignment]  # the only reference left

    def drop(pg_ref: list) -> None:
        if hasattr(pg_ref[0], "abort"):
            pg_ref[0].abort()  # NCCL: aborts the communicator; gloo: a no-op
        pg_ref.clear()
        gc.collect()

    try:
        await asyncio.wait_for(in_thread(drop, ref), 10.0)
    except Exception as e:  # the group is dropped either way; say why tearing it down did not work
        logger.warning("aborting weight-update group %s on the trainer: %s: %s", link.name, type(e).__name__, e)


def _now(fn, *args) -> "asyncio.Future":
    """``fn(*args)`` called here, its result (or exception) as a done future."""
    fut = asyncio.get_running_loop().create_future()
    try:
        fut.set_result(fn(*args))
    except Exception as e:  # handed to the awaiting gather, which names the trainer
        fut.set_exception(e)
    return fut


def _broadcast(group: WeightUpdateGroup, tensors: list[torch.Tensor], device: torch.device):
    """gloo: broadcast and return when done. nccl: queue the broadcast (``wait()`` only orders the
    current stream after it) and return a CUDA event recorded behind it."""
    if device.type != "cuda":
        for t in tensors:
            group.broadcast(t, src=0)
        return None
    torch.cuda.set_device(device)  # a fresh thread starts on the default device
    for t in tensors:
        group.broadcast(t, src=0)
    ev = torch.cuda.Event()
    ev.record()  # on the current stream, which waits for the broadcast
    return ev


async def _destroy_on_engines(members: list[tuple[str, int, EngineClient]], name: str, timeout_s: float) -> None:
    async def one(c: EngineClient):
        return await asyncio.wait_for(c.destroy_weights_update_group(name), timeout_s)

    outs = await asyncio.gather(*(one(c) for _, _, c in members), return_exceptions=True)
    for (url, _, _), out in zip(members, outs):
        if isinstance(out, BaseException):
            logger.warning("destroy_weights_update_group %s on %s: %s: %s", name, url, type(out).__name__, out)


def _failures(keys: list[str], outs: list, what: str) -> dict[str, str]:
    failed = {}
    for k, out in zip(keys, outs):
        if isinstance(out, BaseException):
            failed[k] = f"{what}: {type(out).__name__}: {out}"
        elif isinstance(out, dict) and out.get("success") is False:
            failed[k] = f"{what}: {out.get('message')}"
    return failed
