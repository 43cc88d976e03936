"""The weight-update process group, joined the way SGLang joins it.

The trainer (rank 0) and every engine (ranks ``rank_offset + tp_rank``) are independently
started processes. They meet at a TCP rendezvous on ``master_address:master_port`` hosted by
rank 0; keys are namespaced by a ``PrefixStore`` named after the group, so several groups can
share one store and name clashes are impossible. ``gloo`` on CPU, ``nccl`` on CUDA: same code.

The group is a bare ``ProcessGroup`` object (not registered as torch's default group), so it
works in processes that have their own default group (Megatron ranks, SGLang TP workers) and
in processes that have none (the embedded engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class WeightUpdateGroup:
    """A joined weight-update group. ``store`` is kept alive with it (rank 0 hosts the TCPStore)."""

    pg: dist.ProcessGroup
    store: dist.Store
    backend: str
    rank: int
    world_size: int
    name: str

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: "torch.cuda.Stream | None" = None) -> None:
        """Broadcast ``tensor`` in place from ``src`` and wait for completion (gloo: on the host;
        nccl: the current CUDA stream, or ``stream``, waits for it)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        work = self.pg.broadcast([tensor], opts)
        if stream is None:
            work.wait()
            return
        with torch.cuda.stream(stream):
            work.wait()

    def barrier(self) -> None:
        """A barrier that works on gloo and nccl alike (an all-reduce of one element)."""
        t = torch.zeros(1, device="cuda" if self.backend == "nccl" else "cpu")
        self.pg.allreduce([t]).wait()

    def destroy(self) -> None:
        if hasattr(self.pg, "shutdown"):
            try:
                self.pg.shutdown()
            except RuntimeError:  # already torn down after a peer's exit; nothing left to free
                pass


def init_weight_update_group(backend: str, master_address: str, master_port: int, rank: int,
                             world_size: int, group_name: str, timeout_s: float = 300.0,
                             device: torch.device | None = None) -> WeightUpdateGroup:
    """Join (rank 0: host) the group ``group_name``; blocks until all ``world_size`` ranks join.

    ``device`` (CUDA only) binds the NCCL communicator to that GPU.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: expected 'gloo' or 'nccl'")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0),
                          timeout=timeout, wait_for_workers=False, use_libuv=True)
    prefix = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        pg = dist.ProcessGroupGloo(prefix, rank, world_size, opts)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        if device is not None:
            torch.cuda.set_device(device)
        pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
    return WeightUpdateGroup(pg, store, backend, rank, world_size, group_name)
