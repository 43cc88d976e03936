"""Weight updates for the embedded engine, the way SGLang receives them.

- ``init_group``: join the weight-update group with ``sglang_protocol.process_group``, the steps
  of SGLang's ``init_custom_process_group`` (rank ``rank_offset + tp_rank``; gloo on CPU, nccl on
  CUDA).
- ``begin_session`` / ``end_session``: SGLang >= 0.5.22's weight-update session
  (``/begin_weight_update``, ``/end_weight_update``); ``update_from_distributed`` is refused
  outside one, with SGLang's message, as SGLang refuses it.
- ``update_from_distributed``: receive a bucket broadcast from rank 0, tensor by tensor or as one
  flat ``uint8`` tensor of the bucket's bytes (``load_format: "flattened_bucket"``, SGLang's
  ``FlattenedTensorBucket``), then copy it into the model between two forwards (in the scheduler
  thread), so no forward ever sees a half-updated model.
- ``update_from_tensor``: SGLang's ``/update_weights_from_tensor`` (colocated mode): the body holds
  handles to the trainer's tensors (CUDA IPC, or shared-memory files on the CPU), not their bytes
  (``sglang_protocol/tensor_update.py``); they are opened off the loop, checked like a
  distributed bucket, copied in the same way, and the request is answered only once the copy has
  finished on the device, since the trainer may free or reuse that memory once answered. Refused
  outside a session, as SGLang refuses it. A ``load_format`` on ``--custom-weight-loader``'s list
  is imported and called as SGLang calls it, ``fn(model, named_tensors)``, in the scheduler
  thread, ``model.load_weights`` being that same copy (``sglang_protocol/held_weights.py``).
- ``update_from_disk``: load a checkpoint and copy it in the same way.
- Delta pushes (``--update-weight-mode delta``, ``sglang_protocol/delta_weights.py``): a bucket
  named by a delta header (over the group, or in a directory marked as a delta) is applied in
  place to the parameters, in the scheduler like a copy, if the engine is at the delta's base
  version (else the version's last bucket fails, and the trainer pushes in full).

Where a bucket's time goes matters (bench/weight_sync.py measures it), so:
- gloo receives block until the bucket is here, and NCCL's first collective of a group builds
  its communicator (blocking too): both run in the group's one worker thread, in order. Later
  NCCL receives only queue work on the GPU and are issued on the HTTP loop itself (a thread hop
  per bucket is not free), right after the bucket's answer has gone out (loop
  callbacks run in order, so receives keep the order of the requests); a version's last bucket
  queues its receive and copy before answering.
- On CUDA the copies run on a side stream that waits for each receive, so bucket k+1's receive
  does not wait behind bucket k's copy; the forwards' stream waits for the side stream when a
  version completes, and on ``/continue_generation`` and checksum reads, so even a push that
  stopped midway leaves no copy racing a forward (``_copy_stream``, ``settle``).
- On the CPU, flattened buckets are received into two reused buffers (``_ReceiveBuffers``): new
  pages cost as much to fault in as the gloo transfer itself.
- The copy into the model is queued on the scheduler (it runs between two forwards, in order,
  before any forward that follows it) and answered without waiting, except for the bucket that
  carries ``weight_version``: it waits for its copy and so for every earlier one, and reports
  any earlier failure (of a copy or a deferred receive) instead of switching the version.
Metadata that does not match the model still has its broadcast received (drained) before the
400 is returned, so the group stays consistent for the next bucket. ``trace`` keeps the last
buckets' timings (``/server_info``), which bench/weight_sync.py lines up with the trainer's.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from sglang_protocol import delta_weights
from sglang_protocol.buckets import bucket_layout, parse_dtype, tensor_checksum, unflatten_bucket
from sglang_protocol.process_group import WeightUpdateGroup, init_weight_update_group
from sglang_protocol.tensor_update import LOAD_FORMATS, TensorUpdateRequest, deserialize, named_tensors

from .model_runner import ModelRunner
from .scheduler import Scheduler

log = logging.getLogger(__name__)


class WeightUpdateError(ValueError):
    """A weight-update request that does not fit the model (HTTP 400)."""


@dataclass
class _Group:
    group: WeightUpdateGroup
    executor: concurrent.futures.ThreadPoolExecutor
    joined: bool = False  # a collective has run (NCCL builds its communicator at the first one)


class _ReceiveBuffers:
    """CPU: flat receive buffers kept across buckets and pushes.

    A fresh multi-MB allocation comes back from the OS as new pages, and faulting them in during a
    gloo receive costs about as much as the transfer itself (measured: bench/NOTES.md,
    weight_sync on the CPU). Two slots, so bucket k+1 can arrive while bucket
    k is still being copied into the model; a slot is free again once its copy has run. When both
    are busy a fresh buffer is used (never a wait). Costs up to two buckets of resident memory.
    """

    def __init__(self, slots: int = 2):
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._busy = [False] * slots
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """A ``uint8`` buffer of ``nbytes`` and the function that frees it for reuse."""
        with self._lock:
            free = [i for i, busy in enumerate(self._busy) if not busy]
            if not free:
                return torch.empty(nbytes, dtype=torch.uint8), lambda: None  # [nbytes]
            fits = [i for i in free if self._bufs[i] is not None and self._bufs[i].numel() >= nbytes]
            i = fits[0] if fits else free[0]
            if not fits:
                self._bufs[i] = None  # drop the smaller one before allocating its successor
                self._bufs[i] = torch.empty(nbytes, dtype=torch.uint8)  # [nbytes]
            self._busy[i] = True
            buf = self._bufs[i]

        def release() -> None:
            with self._lock:
                self._busy[i] = False
        return buf[:nbytes], release

    def clear(self) -> None:
        with self._lock:
            self._bufs = [None if not busy else b for b, busy in zip(self._bufs, self._busy)]


class _LoadTarget:
    """The ``model`` a custom weight loader gets: ``load_weights(named_tensors)`` copies them into
    the engine's model (SGLang's models have the same method)."""

    load: Callable[[Any], None] | None = None

    def load_weights(self, named_tensors) -> None:
        if self.load is None:
            raise RuntimeError("load_weights is only callable while a weight update runs")
        self.load(named_tensors)


_loaders: dict[str, Callable] = {}


def _import_loader(path: str) -> Callable:
    """SGLang's ``dynamic_import``: ``module.function``; WeightUpdateError if it cannot be imported."""
    if path not in _loaders:
        import importlib

        module, _, fn = path.rpartition(".")
        try:
            _loaders[path] = getattr(importlib.import_module(module), fn)
        except (ImportError, AttributeError, ValueError) as e:
            raise WeightUpdateError(f"load_format: cannot import {path!r}: {type(e).__name__}: {e}") from e
    return _loaders[path]


class WeightManager:
    """Holds the joined groups and applies received weights through the scheduler."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, timeout_s: float,
                 custom_loaders: list[str] | None = None):
        self.runner = runner
        self.custom_loaders = list(custom_loaders or ())  # SGLang's --custom-weight-loader
        self._load_target = _LoadTarget()  # the ``model`` a custom loader is given (one object: loaders key on it)
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        self.groups: dict[str, _Group] = {}
        self._params = runner.named_tensors()
        self._backup: dict[str, torch.Tensor] | None = None  # weights offloaded by release_memory
        self._released: set[str] = set()  # tags released and not yet resumed (SGLang's offload_tags)
        # Timings of the last buckets received (``/server_info`` shows them): where a push's
        # time goes on the engine side. perf_counter is CLOCK_MONOTONIC, comparable across
        # processes of one host, so the trainer can line these up with its own timeline.
        self.trace: collections.deque[dict[str, float]] = collections.deque(maxlen=256)
        self._apply_error: str | None = None  # a bucket's copy failed since the last version switch
        self._side: torch.cuda.Stream | None = None  # see _copy_stream
        self._recv_buffers = _ReceiveBuffers()  # CPU, flattened buckets
        self.session_open = False  # a weight-update session (/begin_weight_update) is open
        self._delta_push: tuple[str | None, set[int]] = (None, set())  # storages a delta push already changed

    # --- the weight-update session (SGLang >= 0.5.22) ---------------------------------------
    def begin_session(self) -> None:
        """``/begin_weight_update``: open the session that weight loads need (SGLang's rule)."""
        if self.session_open:
            raise WeightUpdateError("a weight-update session is already open; call end_weight_update() first")
        self.session_open = True
        self._apply_error = None  # a failed copy of an abandoned push: that push is redone whole

    def end_session(self) -> None:
        """``/end_weight_update``: close the session (SGLang runs its post-load processing here;
        a plain HF model has none)."""
        if not self.session_open:
            raise WeightUpdateError("no weight-update session is open; call begin_weight_update() first")
        self.session_open = False

    # --- groups -----------------------------------------------------------------------------
    async def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                         group_name: str, backend: str, connect_timeout_s: float | None = None) -> None:
        if group_name in self.groups:
            raise WeightUpdateError(f"group_name: group {group_name!r} already exists")
        if backend not in ("gloo", "nccl"):
            raise WeightUpdateError(f"backend: {backend!r} is not gloo or nccl")
        if backend == "nccl" and self.runner.device.type != "cuda":
            raise WeightUpdateError("backend: nccl needs a CUDA engine (--device cuda); use gloo on CPU")
        tp_rank = 0  # one model replica per engine process
        ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"wgroup-{group_name}")
        loop = asyncio.get_running_loop()
        try:
            group = await loop.run_in_executor(ex, lambda: init_weight_update_group(
                backend, master_address, master_port, rank_offset + tp_rank, world_size, group_name,
                self.timeout_s, self.runner.device if backend == "nccl" else None, connect_timeout_s))
        except BaseException:
            ex.shutdown(wait=False)
            raise
        self.groups[group_name] = _Group(group, ex)

    def destroy_group(self, group_name: str) -> None:
        g = self.groups.pop(group_name, None)
        if g is None:
            raise WeightUpdateError(f"group_name: no group {group_name!r}")
        g.executor.submit(g.group.destroy).result(timeout=self.timeout_s)
        g.executor.shutdown(wait=False)
        if not self.groups:  # no push can come without a new group: give the receive buffers back
            self._recv_buffers.clear()

    def close(self) -> None:
        for name in list(self.groups):
            try:
                self.destroy_group(name)
            except Exception:
                log.exception("destroying weight-update group %s", name)

    # --- updates ----------------------------------------------------------------------------
    async def update_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                      group_name: str, load_format: str | None,
                                      weight_version: str | None = None) -> None:
        rec = {"handler": time.perf_counter()}  # this bucket's timeline (``self.trace``)
        if not self.session_open:  # SGLang answers so without receiving the broadcast
            raise WeightUpdateError("update_weights_from_distributed must run between "
                                    "begin_weight_update() and end_weight_update()")
        g = self.groups.get(group_name)
        if g is None:
            raise WeightUpdateError(f"group_name: no group {group_name!r} (call /init_weights_update_group)")
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise WeightUpdateError("names/dtypes/shapes: must be non-empty lists of equal length")
        try:
            tdtypes = [parse_dtype(d) for d in dtypes]
            tshapes = [tuple(int(x) for x in s) for s in shapes]
        except (TypeError, ValueError) as e:
            raise WeightUpdateError(f"dtypes/shapes: {e} (the broadcast could not be drained)") from e
        flat = load_format == "flattened_bucket"
        if load_format not in (None, "flattened_bucket"):
            raise WeightUpdateError(f"load_format: {load_format!r} is not supported (None or flattened_bucket); "
                                    "the broadcast was not drained")
        if flat:
            try:
                layout = bucket_layout(tdtypes, tshapes)
            except ValueError as e:
                raise WeightUpdateError(f"dtypes/shapes: {e} (the broadcast was not drained)") from e
            nbytes = layout[-1][0] + layout[-1][1]
        delta, problem = self._delta_of(names)
        if delta is None and problem is None:
            problem = self._check(names, tdtypes, tshapes)  # validated now, reported after draining
        loader = self._delta_loader(delta) if delta is not None else None
        dev = self.runner.device
        numels = [math.prod(sh) for sh in tshapes]
        rec["bytes"] = float(sum(n * dt.itemsize for n, dt in zip(numels, tdtypes)))

        side = self._copy_stream()  # CUDA: the stream the received tensors are ready on
        held: list[Callable[[], None]] = []  # CPU: frees the reused receive buffer once copied

        def receive() -> list[torch.Tensor]:
            rec["recv_start"] = time.perf_counter()
            if flat:
                if dev.type == "cpu":
                    buf, release = self._recv_buffers.take(nbytes)  # [bytes]
                    held.append(release)
                else:  # the caching allocator already reuses GPU memory
                    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)  # [bytes]
                g.group.broadcast(buf, src=0, stream=side)
                return unflatten_bucket(buf, tdtypes, tshapes)  # views, one per tensor
            out = []
            for dt, sh in zip(tdtypes, tshapes):
                t = torch.empty(sh, dtype=dt, device=dev)
                g.group.broadcast(t, src=0, stream=side)
                out.append(t)
            return out

        if g.group.backend == "nccl" and g.joined and weight_version is None and not problem:
            # NCCL only queues the receive on the GPU: it is issued on this loop right after the
            # answer goes out (callbacks run in order, so receives keep the order of requests), so
            # the trainer's next request overlaps this one's enqueue. A failure is reported by the
            # version's last bucket, which then leaves the version unchanged.
            asyncio.get_running_loop().call_soon(self._receive_and_apply, receive, names, rec, loader)
            return
        if g.group.backend == "nccl" and g.joined:  # the last bucket: answered once its copy is queued
            tensors = receive()
        else:  # gloo blocks until the bucket is here; NCCL's first collective builds the communicator
            try:
                tensors = await asyncio.get_running_loop().run_in_executor(g.executor, receive)
            except BaseException:
                for release in held:
                    release()
                raise
            g.joined = True
        rec["recv_queued"] = time.perf_counter()
        if problem:
            for release in held:
                release()
            raise WeightUpdateError(problem)
        applied = self._apply(dict(zip(names, tensors)), weight_version, held[0] if held else None,
                              final=weight_version is not None, loader=loader)
        if weight_version is not None:
            # The bucket that completes a version waits for its copy (and, being queued after
            # them, for every earlier bucket's), so the reported version is the one served.
            try:
                await applied
            except BaseException:
                self._apply_error = None  # reported to this request already, not to a later push
                raise
        else:  # a failure is reported by the version's last bucket (see _apply)
            applied.add_done_callback(lambda f: f.cancelled() or f.exception())
        rec["applied"] = time.perf_counter()
        self.trace.append(rec)

    def _copy_stream(self) -> "torch.cuda.Stream | None":
        """CUDA: the side stream that waits for received buckets and copies them into the model.

        NCCL orders each receive after the work already queued on the current stream; with the
        copies on that stream too, bucket k+1's receive waited for bucket k's copy (a gap between
        transfers: bench/NOTES.md "weight_sync"). Copies on a side stream let receives run
        back to back; the forwards' stream waits for the side stream when a version completes
        (or when a copy lands outside a pause), so no forward reads weights being written.
        """
        if self.runner.device.type != "cuda":
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(self.runner.device)
        return self._side

    def _receive_and_apply(self, receive, names: list[str], rec: dict, loader: Callable | None = None) -> None:
        """A deferred NCCL receive (see update_from_distributed): queue it, then the copy."""
        try:
            tensors = receive()
        except Exception as e:  # the group is broken; the version's last bucket reports it
            self._apply_error = f"receiving {len(names)} tensors failed: {type(e).__name__}: {e}"
            log.exception("weight update: deferred receive failed")
            return
        rec["recv_queued"] = time.perf_counter()
        self._apply(dict(zip(names, tensors)), None, final=False, loader=loader).add_done_callback(
            lambda f: f.cancelled() or f.exception())
        rec["applied"] = time.perf_counter()
        self.trace.append(rec)

    async def update_from_tensor(self, req: TensorUpdateRequest, tp_rank: int = 0) -> None:
        """``/update_weights_from_tensor``: open this rank's payload (handles to the trainer's
        tensors), check it against the model, copy it in between two forwards, and return once the
        copy has finished: the trainer may free or reuse that memory as soon as this is answered."""
        if not self.session_open:  # SGLang answers so before opening the payload
            raise WeightUpdateError("update_weights_from_tensor must run between "
                                    "begin_weight_update() and end_weight_update()")
        if tp_rank >= len(req.serialized_named_tensors):
            raise WeightUpdateError(f"serialized_named_tensors: {len(req.serialized_named_tensors)} payloads, "
                                    f"none for TP rank {tp_rank}")
        loader = None
        if req.load_format not in LOAD_FORMATS:  # SGLang: only a path on its list is imported
            if req.load_format not in self.custom_loaders:
                raise WeightUpdateError(f"load_format: {req.load_format!r} is not a --custom-weight-loader of this "
                                        f"engine (it allows {self.custom_loaders or 'none'})")
            loader = _import_loader(req.load_format)
        rec = {"handler": time.perf_counter()}  # this bucket's timeline (``self.trace``)

        def open_payload() -> dict[str, torch.Tensor]:
            # Off the loop: opening CUDA IPC handles blocks. The tensors stay where the handles
            # point (a device other than the engine's too): the copy into the model reads them there.
            try:
                named = named_tensors(deserialize(req.serialized_named_tensors[tp_rank]), req.load_format)
            except Exception as e:  # a payload that cannot be opened is a bad request, whatever broke
                raise WeightUpdateError(f"serialized_named_tensors[{tp_rank}]: {type(e).__name__}: {e}") from e
            if loader is None:  # a custom loader's payload is its own to read: its load_weights checks
                self._check_named(named)
            return dict(named)

        tensors = await asyncio.get_running_loop().run_in_executor(None, open_payload)
        rec["recv_queued"] = time.perf_counter()
        rec["bytes"] = float(sum(t.numel() * t.element_size() for t in tensors.values()))
        try:
            await self._apply(tensors, req.weight_version, drain=True, loader=loader)
        except BaseException:
            self._apply_error = None  # reported to this request already, not to a later bucket
            raise
        rec["applied"] = time.perf_counter()
        self.trace.append(rec)

    async def update_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        from transformers import AutoModelForCausalLM

        if (Path(model_path) / delta_weights.DELTA_MARKER).is_file():
            return await self._delta_from_disk(Path(model_path) / delta_weights.DELTA_FILE, weight_version)

        def load() -> dict[str, torch.Tensor]:
            m = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.runner.dtype, local_files_only=True)
            return dict(m.named_parameters(remove_duplicate=False))

        try:
            state = await asyncio.get_running_loop().run_in_executor(None, load)
        except (OSError, ValueError) as e:
            raise WeightUpdateError(f"model_path: cannot load {model_path!r}: {e}") from e
        missing = sorted(set(self._params) - set(state))
        if missing:
            raise WeightUpdateError(f"model_path: checkpoint lacks {missing[0]} ({len(missing)} tensors missing)")
        problem = self._check(list(state), [t.dtype for t in state.values()],
                              [tuple(t.shape) for t in state.values()])
        if problem:
            raise WeightUpdateError(f"model_path: {problem}")
        await self._apply(state, weight_version)

    def _delta_of(self, names: list[str]) -> tuple[dict | None, str | None]:
        """``(meta, None)`` for a delta bucket whose tensors are the model's, ``(None, problem)`` for
        one that is not, ``(None, None)`` for a plain bucket."""
        if not any(delta_weights.is_delta(n) for n in names):
            return None, None
        if len(names) != 1:
            return None, "a delta bucket travels alone: one name, its header"
        try:
            meta = delta_weights.parse_header(names[0])
        except delta_weights.DeltaError as e:
            return None, str(e)
        dtype = parse_dtype(meta["dtype"])
        for n, sh in zip(meta["names"], meta["shapes"]):
            p = self._params.get(n)
            if p is None:
                return None, f"{n}: no such parameter in the model"
            if list(p.shape) != list(sh) or p.dtype != dtype:
                return None, (f"{n}: a delta of {dtype} {list(sh)}, the model holds {p.dtype} {list(p.shape)} "
                              "(deltas are taken in the engine's dtype)")
        return meta, None

    def _delta_loader(self, meta: dict) -> Callable:
        """The loader ``_apply`` runs in the scheduler for one delta bucket: checks the base version,
        then applies the delta in place (a storage that two names share gets it once per push)."""
        params, sched = self._params, self.scheduler

        def load(_target: Any, named: list[tuple[str, torch.Tensor]]) -> None:
            if str(meta["base"]) != str(sched.weight_version):
                raise delta_weights.DeltaError(f"a delta against weight version {meta['base']!r}; this engine is at "
                                               f"{sched.weight_version!r}")
            push = meta.get("push")
            if self._delta_push[0] != push:
                self._delta_push = (push, set())
            done = self._delta_push[1]
            targets = [params[n] for n in meta["names"]]
            skip = {i for i, t in enumerate(targets) if t.untyped_storage().data_ptr() in done}
            delta_weights.apply(meta, named[0][1], targets, skip=skip)
            done.update(t.untyped_storage().data_ptr() for t in targets)
        return load

    async def _delta_from_disk(self, path: "Path", weight_version: str | None) -> None:
        """A delta directory: every bucket in it, applied in one scheduler command, in file order."""
        from safetensors import safe_open

        def read() -> list[tuple[str, torch.Tensor]]:
            with safe_open(str(path), "pt") as f:
                return [(n, f.get_tensor(n)) for n in f.keys()]
        try:
            buckets = await asyncio.get_running_loop().run_in_executor(None, read)
        except (OSError, ValueError) as e:
            raise WeightUpdateError(f"model_path: cannot read the delta {str(path)!r}: {e}") from e
        loaders = []
        for name, _ in buckets:
            meta, problem = self._delta_of([name])
            if problem or meta is None:
                raise WeightUpdateError(f"model_path: {problem or 'not a delta bucket: ' + name[:80]}")
            loaders.append(self._delta_loader(meta))

        def load_all(target: Any, named: list[tuple[str, torch.Tensor]]) -> None:
            for ld, pair in zip(loaders, named):
                ld(target, [pair])
        await self._apply(dict(buckets), weight_version, loader=load_all)

    def _check_named(self, named: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """``named``, or WeightUpdateError saying what does not fit the model."""
        problem = self._check([n for n, _ in named], [t.dtype for _, t in named], [tuple(t.shape) for _, t in named])
        if problem:
            raise WeightUpdateError(problem)
        return named

    def _check(self, names: list[str], dtypes: list[torch.dtype], shapes: list[tuple[int, ...]]) -> str | None:
        for n, dt, sh in zip(names, dtypes, shapes):
            p = self._params.get(n)
            if p is None:
                return f"{n}: no such parameter in the model"
            if tuple(p.shape) != sh:
                return f"{n}: shape {list(sh)} does not match the model's {list(p.shape)}"
            if not dt.is_floating_point:
                return f"{n}: dtype {dt} is not a floating-point dtype"
        return None

    def _apply(self, tensors: dict[str, Any], weight_version: str | None,
               release: Callable[[], None] | None = None, final: bool = True,
               drain: bool = False, loader: Callable | None = None) -> "asyncio.Future[None]":
        """Queue the copy of ``tensors`` into the model between two forwards (the scheduler runs
        commands in order, before any forward that follows them). Returns a future of it.
        ``release()`` runs once the copy has run (or failed): ``tensors`` are free for reuse.
        ``final=False`` (a bucket that does not complete a version, engine paused): on CUDA the
        forwards' stream is not made to wait for this copy yet (the version's last bucket, or
        ``settle``, does that). ``drain``: the future completes only once the copy has finished
        on the device too (``tensors`` live in memory that their owner reuses afterwards).
        ``loader``: a custom weight loader, called with the tensors in place of the copy (its
        ``model.load_weights`` runs the copy).

        Buckets that do not complete a version are not waited for (one thread hop less per
        bucket): their copies run in queue order, and a failure is remembered and reported by
        the bucket that completes the version, which then leaves the version unchanged.
        """
        params, sched = self._params, self.scheduler

        side = self._copy_stream()

        def copy() -> None:
            try:
                if loader is None:
                    load(tensors)
                else:
                    self._load_target.load = lambda named: load(dict(self._check_named(list(named))))
                    try:
                        loader(self._load_target, list(tensors.items()))
                    finally:
                        self._load_target.load = None
            except Exception as e:
                self._apply_error = f"copying {len(tensors)} tensors into the model failed: {type(e).__name__}: {e}"
                raise
            finally:
                if release is not None:  # CPU copies are synchronous: done here
                    release()
                if drain:  # the scheduler may hold this closure a while: let the owner's memory go now
                    tensors.clear()
            if weight_version is not None:  # the version switches with the weights, atomically
                error, self._apply_error = self._apply_error, None
                if error:
                    raise RuntimeError(f"weight_version {weight_version} not applied: an earlier bucket failed: {error}")
                sched.weight_version = str(weight_version)

        def load(named: dict[str, Any]) -> None:
            # Flat views on both sides (a received bucket arrives as 1-D parts): one fused copy.
            pairs = [(params[n].view(-1), t.reshape(-1)) if params[n].is_contiguous()
                     else (params[n], t.reshape(params[n].shape)) for n, t in named.items()]
            same = [(p, t) for p, t in pairs if p.dtype == t.dtype]
            if side is not None:  # after the forwards already queued (they read these weights)
                side.wait_stream(torch.cuda.current_stream(side.device))
            with torch.no_grad(), (torch.cuda.stream(side) if side is not None else contextlib.nullcontext()):
                if same:  # one fused launch for the bucket instead of one copy per tensor
                    torch._foreach_copy_([p for p, _ in same], [t for _, t in same])
                for p, t in pairs:
                    if p.dtype != t.dtype:
                        p.copy_(t)  # casts to the engine's dtype
            if side is not None:
                for _, t in pairs:  # the caching allocator must not reuse them before the copy ran
                    if t.is_cuda:
                        t.record_stream(side)
                if final or not sched.paused:  # forwards (or reads) may follow
                    torch.cuda.current_stream(side.device).wait_stream(side)
                if drain:
                    side.synchronize()

        if self.runner.device.type == "cuda" and weight_version is not None:
            # A version's last bucket is answered only once its copy is queued; paused for a push,
            # with no earlier copy pending, it is queued from here (a thread hop saved).
            return asyncio.wrap_future(self.scheduler.run_now_if_paused(copy))
        try:
            return asyncio.wrap_future(self.scheduler.run_command(copy))
        except BaseException:  # shutting down: the copy never runs
            if release is not None:
                release()
            raise

    # --- colocated mode ----------------------------------------------------------------------
    async def release_memory(self, tags: list[str]) -> None:
        """Free accelerator memory for a colocated trainer (SGLang's release_memory_occupation).

        Needs an idle engine; generation stays paused until ``resume_memory``. Weights are kept
        in a host-memory backup (on a CPU engine they already live there, so nothing moves).
        The KV cache is per running request, so an idle engine holds none."""
        bad = [t for t in tags if t not in ("weights", "kv_cache")]
        if bad:
            raise WeightUpdateError(f"tags: unknown tag {bad[0]!r} (weights, kv_cache)")
        if self.scheduler.load()["num_reqs"]:
            raise WeightUpdateError("requests are in flight: abort or finish them before releasing memory")
        self.scheduler.pause("in_place")
        self._released.update(tags)
        if "weights" in tags and self.runner.device.type != "cpu" and self._backup is None:
            params = self._params

            def offload() -> dict[str, torch.Tensor]:
                backup, seen = {}, set()
                for n, p in params.items():
                    if id(p) not in seen:  # tied weights: one backup per Parameter
                        seen.add(id(p))
                        backup[n] = p.data.to("cpu")
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                torch.cuda.empty_cache()
                return backup
            self._backup = await asyncio.wrap_future(self.scheduler.run_command(offload))

    async def resume_memory(self, tags: list[str]) -> None:
        """Bring released memory back and continue generation (SGLang's resume_memory_occupation).
        A tag that was not released is refused, as SGLang's scheduler fails on it (a restarted
        engine holds all its memory: resuming it is the caller's mistake)."""
        never = [t for t in tags if t not in self._released]
        if never:
            raise WeightUpdateError(f"tags: {never[0]!r} was not released (release_memory_occupation first)")
        self._released.difference_update(tags)
        if self._backup is not None and "weights" in tags:
            params, backup, dev = self._params, self._backup, self.runner.device

            def restore() -> None:
                for n, t in backup.items():
                    params[n].data = t.to(dev)
            await asyncio.wrap_future(self.scheduler.run_command(restore))
            self._backup = None
        if self._backup is None:
            self.scheduler.resume()

    def settle(self) -> None:
        """Queue, behind the copies already queued, a wait of the forwards' stream for the side
        copy stream (CUDA), so whatever runs next reads finished weights even when a push stopped
        before its last bucket. Not waited for: the scheduler runs it before its next forward.
        Called on ``/continue_generation``."""
        side = self._side
        if side is None:
            return
        try:
            self.scheduler.run_command(lambda: torch.cuda.current_stream(side.device).wait_stream(side))
        except RuntimeError:  # shutting down: no forward follows
            pass

    async def leading_rows(self, name: str, count: int) -> list | None:
        """SGLang's ``/get_weights_by_name`` answer: the parameter's first ``count`` rows as float32
        lists, read between forwards; None for a name the model does not hold (SGLang's runner
        answers None after catching its model's error)."""
        params = self._params
        if name not in params:
            return None
        side = self._side

        def read() -> list:
            if side is not None:
                torch.cuda.current_stream(side.device).wait_stream(side)
            return params[name].detach()[:count].float().cpu().tolist()
        return await asyncio.wrap_future(self.scheduler.run_command(read))

    async def checksums(self, names: list[str] | None, dtype: torch.dtype | None) -> dict[str, str]:
        """``{name: tensor_checksum}`` of the model's parameters (HF names), read between forwards."""
        params = self._params
        wanted = names if names is not None else list(params)
        unknown = [n for n in wanted if n not in params]
        if unknown:
            raise WeightUpdateError(f"names: no such parameter {unknown[0]!r}")
        side = self._side

        def read() -> dict[str, str]:
            if side is not None:  # copies of an unfinished push may still run there
                torch.cuda.current_stream(side.device).wait_stream(side)
            return {n: tensor_checksum(params[n], dtype) for n in wanted}
        return await asyncio.wrap_future(self.scheduler.run_command(read))
