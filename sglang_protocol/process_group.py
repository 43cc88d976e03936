"""The weight-update process group, built exactly as SGLang's engine side builds it.

The trainer (rank 0) and every engine rank (``rank_offset + tp_rank``) are independently
started processes. SGLang's engine joins with ``sglang.srt.utils.common.init_custom_process_group``:
a ``tcp://`` rendezvous (rank 0 hosts the TCPStore), ``PrefixStore(group_name, store)``, then
torch's ``_new_process_group_helper``, which prefixes the keys twice more (``"{group_name}/"``,
``"{device}/"``). Any other construction waits on other keys and never meets SGLang's ranks, so
this module follows the same steps (slime's trainer side does too). The embedded engine joins
with this same function; ``tests/test_sglang_conformance.py`` runs SGLang's own function against
it. ``gloo`` on CPU, ``nccl`` on CUDA: same code.

The group is registered in torch's process-group registry (as SGLang's is) but is never the
default group, so it works in processes that have one (Megatron ranks, SGLang TP workers) and in
processes that have none (the embedded engine).

Rank 0's TCPStore listens on ``master_address`` only (torch's own binds every interface): the
socket is bound here and handed to the store, so with the default ``127.0.0.1`` no other host can
reach it; multi-node runs give the node IP the engines should connect to. The other ranks give up
connecting after ``connect_timeout_s`` (an unreachable address fails fast instead of holding a
thread for the whole group timeout).
"""

from __future__ import annotations

import gc
import logging
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

log = logging.getLogger(__name__)


def tcp_init_method(host: str, port: int) -> str:
    """``tcp://host:port`` (an IPv6 literal in brackets), the form SGLang's ``NetworkAddress.to_tcp`` gives."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


@dataclass
class WeightUpdateGroup:
    """A joined weight-update group (a registered, non-default torch ProcessGroup)."""

    pg: dist.ProcessGroup | None
    store: dist.Store  # the group's PrefixStore (rank 0 hosts the TCPStore under it)
    backend: str
    rank: int
    world_size: int
    name: str

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: "torch.cuda.Stream | None" = None) -> None:
        """Broadcast ``tensor`` in place from ``src`` and wait for completion (gloo: on the host;
        nccl: the current CUDA stream, or ``stream``, waits for it).

        Issued on the ProcessGroup object itself with group-local ranks (``src`` is a rank of
        this group), the same collective SGLang's ``torch.distributed.broadcast(..., group=pg)``
        issues."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        work = self._live().broadcast([tensor], opts)
        if stream is None:
            work.wait()
            return
        with torch.cuda.stream(stream):
            work.wait()

    def barrier(self) -> None:
        """A barrier that works on gloo and nccl alike (an all-reduce of one element)."""
        t = torch.zeros(1, device="cuda" if self.backend == "nccl" else "cpu")
        self._live().allreduce([t]).wait()

    def destroy(self) -> None:
        """Leave the group gracefully (``torch.distributed.destroy_process_group``, as SGLang's
        ``/destroy_weights_update_group`` does). Idempotent."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        try:
            dist.destroy_process_group(pg)
        except (RuntimeError, ValueError) as e:  # torn down already after a peer's exit
            log.debug("destroying weight-update group %s: %s", self.name, e)
            _unregister(pg)

    def abort(self) -> None:
        """Drop the group at once, without the graceful shutdown (which waits for dead peers).

        NCCL: ``abort()`` tears the communicator down. gloo: ``abort()`` does nothing (torch 2.13),
        but dropping the last reference closes the connections, which wakes peers blocked in a
        receive; so the group is also removed from torch's registry, which holds a reference."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        if hasattr(pg, "abort"):
            try:
                pg.abort()
            except RuntimeError as e:
                log.debug("aborting weight-update group %s: %s", self.name, e)
        _unregister(pg)
        del pg
        gc.collect()

    def _live(self) -> dist.ProcessGroup:
        if self.pg is None:
            raise RuntimeError(f"weight-update group {self.name!r} was destroyed or aborted")
        return self.pg


def init_weight_update_group(backend: str, master_address: str, master_port: int, rank: int,
                             world_size: int, group_name: str, timeout_s: float = 300.0,
                             device: torch.device | None = None,
                             connect_timeout_s: float | None = None) -> WeightUpdateGroup:
    """Join (rank 0: host) the group ``group_name``; blocks until all ``world_size`` ranks join.

    The steps of SGLang's ``init_custom_process_group(backend, init_method=tcp://...,
    world_size, rank, group_name)``. ``device`` (CUDA only) is made the current device first, so
    the NCCL communicator binds to that GPU. A ``group_name`` must be unique within a process
    while its group exists (torch's registry refuses a second one). Rank 0 hosts the rendezvous
    on ``master_address`` alone; other ranks wait at most ``connect_timeout_s`` (default
    ``timeout_s``) to reach it.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: expected 'gloo' or 'nccl'")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if not group_name:
        raise ValueError("group_name: must not be empty")
    if backend == "nccl" and device is not None:
        if device.type == "cuda" and device.index is None:  # "cuda": the current GPU
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store: dist.Store = _bound_store(master_address, master_port, world_size, timeout)
    else:
        connect = timedelta(seconds=min(timeout_s, connect_timeout_s or timeout_s))
        store, rank, world_size = next(c10d.rendezvous(tcp_init_method(master_address, master_port), rank,
                                                       world_size, timeout=connect))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], dist.Backend(backend), store,
                                           group_name=group_name, backend_options=None, timeout=timeout,
                                           device_id=None)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return WeightUpdateGroup(pg, store, backend, rank, world_size, group_name)


def _bound_store(host: str, port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """Rank 0's TCPStore listening on ``host`` only: the socket is bound here and handed over."""
    addr = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise RuntimeError(f"weight-update group: cannot listen on {host}:{port}: {e}") from e
    fd = sock.detach()  # the store owns the descriptor from here
    return dist.TCPStore(addr, port, world_size, True, timeout, wait_for_workers=False,
                         multi_tenant=False, master_listen_fd=fd, use_libuv=True)


def _unregister(pg: dist.ProcessGroup) -> None:
    """Remove ``pg`` from torch's process-group registry without shutting it down."""
    w = c10d._world
    for table in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config, w.pg_coalesce_state):
        table.pop(pg, None)
    tag = w.pg_to_tag.pop(pg, None)
    if tag is not None and pg in w.tags_to_pg.get(tag, []):
        w.tags_to_pg[tag].remove(pg)
    try:
        c10d._unregister_process_group(pg.group_name)
    except (AttributeError, RuntimeError, KeyError):  # not registered by name on this torch
        pass
