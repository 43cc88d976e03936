"""One weight-update group between trainer rank 0 and a set of engines, and sending over it.

``open_link`` joins the group the way SGLang does: every engine gets POST
``/init_weights_update_group`` (its ``rank_offset`` = 1 + GPUs of the engines before it) while
rank 0 hosts the TCP rendezvous and joins in a thread; ``send_bucket`` POSTs a bucket's metadata
to every engine and broadcasts the bucket from rank 0 while those requests are in flight (each
engine receives inside its handler). Every step is bounded by ``timeout_s``; a failure raises
``PushFailed`` naming each engine (or ``trainer``) that failed.

The ``tensor`` transport (colocated mode) has no group: ``TensorChannel.pack`` keeps a bucket on
the trainer's device and ``send_tensor_bucket`` POSTs ``/update_weights_from_tensor`` with handles
to it (``sglang_protocol/tensor_update.py``) to every engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sglang_protocol.client import EngineClient
from sglang_protocol.net import free_port
from weight_sync._loop import SerialThread, in_thread
from sglang_protocol import tensor_update
from sglang_protocol.buckets import flatten_bucket, parse_dtype, unflatten_bucket
from weight_sync.interfaces import WeightSyncSettings
from weight_sync.plan import Bucket
from sglang_protocol.process_group import WeightUpdateGroup, init_weight_update_group

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
        """The tensors to broadcast for ``bucket``: its bytes as one flat ``uint8`` tensor (SGLang's
        flattened bucket), or each tensor (contiguous). Tensors of another dtype than the bucket's
        (the engines') are cast on the way in: one copy per tensor, into the bucket itself."""
        dtype = parse_dtype(bucket.dtype)
        with torch.no_grad():
            ts = [named[i][1].detach() for i in bucket.indices]
            if any(t.dtype != dtype for t in ts):
                if not self.flattened:
                    return [t.to(device, dtype, non_blocking=device.type == "cuda").contiguous() for t in ts]
                flat = self._slot(bucket.nbytes) if device.type == "cpu" else \
                    torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)  # [bytes]
                return [fill_cast(flat, ts, dtype)]
            ts = [t.to(device, non_blocking=True) for t in ts]
            if self.flattened:
                if len(ts) == 1 and ts[0].is_contiguous():
                    return [ts[0].reshape(-1).view(torch.uint8)]  # [bytes], a view: no packing copy
                if device.type == "cpu":
                    return [self._pack_cpu(ts, bucket.nbytes)]
                return [flatten_bucket(ts)]  # [bytes]
            return [t.contiguous() for t in ts]

    def _pack_cpu(self, ts: list[torch.Tensor], nbytes: int) -> torch.Tensor:
        flat = self._slot(nbytes)  # [bytes]
        torch.cat([t.reshape(-1).view(torch.uint8) for t in ts], out=flat)
        return flat

    def _slot(self, nbytes: int) -> torch.Tensor:
        """The next of the two CPU packing buffers, as ``nbytes`` bytes."""
        slot = self._packs % 2
        self._packs += 1
        buf = self._staging[slot]
        if buf is None or buf.numel() < nbytes:
            buf = self._staging[slot] = torch.empty(nbytes, dtype=torch.uint8)  # [bytes]
        return buf[:nbytes]  # [bytes]


@dataclass
class TensorChannel:
    """What the ``tensor`` transport keeps between buckets and pushes: the load format and, on the
    CPU, two reused staging buffers in shared memory (bucket k packs into slot k % 2; engines
    answer a bucket once they have copied it, so slot k % 2 is free again when bucket k + 2 packs)."""

    flattened: bool
    _staging: list = field(default_factory=lambda: [None, None])
    _packs: int = 0

    def pack(self, named: list[tuple[str, torch.Tensor]], bucket: Bucket) -> tuple[Any, list[torch.Tensor]]:
        """``(obj, keep)``: what each engine rank deserialises for ``bucket`` (a flattened bucket, or
        ``(name, tensor)`` pairs) and the tensors its handles point into, which must stay alive
        until every engine has answered.

        On CUDA the handles point at the trainer's memory: a lone contiguous tensor is sent as
        is, several are packed into one flat buffer on their GPU (one handle per bucket), and
        without flattening each tensor is sent as is. On the CPU the bucket is staged in shared
        memory (sending a trainer tensor would move it there in place)."""
        names = [s.name for s in bucket.specs]
        dtypes = [parse_dtype(s.dtype) for s in bucket.specs]
        shapes = [s.shape for s in bucket.specs]
        dtype = parse_dtype(bucket.dtype)  # the engines' (tensors of another dtype are cast while packing)
        with torch.no_grad():
            ts = [named[i][1].detach() for i in bucket.indices]
            cast = any(t.dtype != dtype for t in ts)
            dev = ts[0].device
            if dev.type == "cuda":
                ts = [t.to(dev, dtype) for t in ts] if cast and not self.flattened else [t.to(dev) for t in ts]
                if not self.flattened:
                    ts = [t.contiguous() for t in ts]
                    return list(zip(names, ts)), ts
                if cast:  # one copy per tensor, into the bucket itself
                    flat = fill_cast(torch.empty(bucket.nbytes, dtype=torch.uint8, device=dev), ts, dtype)  # [bytes]
                elif len(ts) == 1 and ts[0].is_contiguous():
                    flat = ts[0].reshape(-1).view(torch.uint8)  # [bytes], a view: no packing copy
                else:
                    flat = flatten_bucket(ts)  # [bytes]
            else:
                flat = self._stage(ts, bucket.nbytes, dtype if cast else None)  # [bytes]
                if not self.flattened:
                    return list(zip(names, unflatten_bucket(flat, dtypes, shapes))), [flat]
        return tensor_update.flattened_bucket(names, flat, dtypes, shapes), [flat]

    def _stage(self, ts: list[torch.Tensor], nbytes: int, cast_to: torch.dtype | None = None) -> torch.Tensor:
        slot = self._packs % 2
        self._packs += 1
        buf = self._staging[slot]
        if buf is None or buf.numel() < nbytes:
            self._staging[slot] = None  # drop the smaller one before allocating its successor
            buf = self._staging[slot] = tensor_update.shared_cpu_buffer(nbytes)  # [bytes]
        flat = buf[:nbytes]  # [bytes]
        if cast_to is not None:
            return fill_cast(flat, ts, cast_to)
        torch.cat([t.reshape(-1).view(torch.uint8) for t in ts], out=flat)
        return flat


def fill_cast(flat: torch.Tensor, ts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Write ``ts``, cast to ``dtype``, one after another into the ``uint8`` buffer ``flat`` (a
    flattened bucket of ``dtype``: every offset is aligned); returns ``flat``. One copy per tensor
    (``copy_`` casts and moves devices as it writes), so a cast never holds a second copy of the
    bucket, let alone of the model."""
    offset = 0
    for t in ts:
        n = t.numel() * dtype.itemsize
        flat[offset:offset + n].view(dtype).view(t.shape).copy_(t, non_blocking=flat.is_cuda)
        offset += n
    if offset != flat.numel():
        raise ValueError(f"fill_cast: the tensors hold {offset} bytes as {dtype}, the bucket {flat.numel()}")
    return flat


async def send_tensor_bucket(load_format: str | None, members: list[tuple[str, int, EngineClient]], obj: Any,
                             settings: WeightSyncSettings, weight_version: str | None, flush_cache: bool,
                             after_issue: Callable[[], None] | None = None) -> None:
    """POST ``/update_weights_from_tensor`` with ``obj`` (from ``TensorChannel.pack``, or
    ``held_weights.pack``'s pairs with its loader as ``load_format``) to every member, serialised
    once per TP rank; returns when every engine has answered, i.e. has copied the tensors.
    ``after_issue()`` runs once the requests are out, while the answers are awaited. PushFailed
    naming each engine (or the trainer, if serialising failed) that failed."""
    try:
        bodies = [tensor_update.request_body(obj, g, load_format, flush_cache, weight_version)
                  for _, g, _ in members]
    except Exception as e:  # nothing was sent
        raise PushFailed({TRAINER: f"serialising the bucket: {type(e).__name__}: {e}"}) from e
    posts = [asyncio.ensure_future(c.update_weights_from_tensor(body, settings.timeout_s))
             for (_, _, c), body in zip(members, bodies)]
    error = None
    if after_issue is not None:
        await asyncio.sleep(0)  # the requests are written first
        try:
            after_issue()
        except Exception as e:  # raised once this bucket's requests are settled
            error = e
    outs = await asyncio.gather(*posts, return_exceptions=True)
    if error is not None:
        raise error
    failed = _failures([u for u, _, _ in members], outs, "update_weights_from_tensor")
    if failed:
        raise PushFailed(failed)


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
    """Tear down rank 0's side of a failed group at once (``WeightUpdateGroup.abort``): engines
    still blocked in a receive of this bucket then fail now instead of at their own, possibly
    long, timeout."""
    link.broken = True
    link.worker.stop()
    try:
        await asyncio.wait_for(in_thread(link.group.abort), 10.0)
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
