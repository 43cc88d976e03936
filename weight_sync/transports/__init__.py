"""How weights travel from trainer rank 0 to the engines: one class per transport behind
``transports.base.Transport``, chosen once from the settings by ``make_transport``.

- ``distributed.py``: a weight-update group (NCCL/gloo) and a broadcast per bucket;
- ``tensor.py``: handles to the trainer's buckets (CUDA IPC; shared memory on the CPU) through
  ``/update_weights_from_tensor``, and the ``mapped`` held-weights format (colocated mode);
- ``disk.py``: an HF checkpoint per version and ``/update_weights_from_disk``.
"""

from __future__ import annotations

from weight_sync.interfaces import WeightSyncSettings
from weight_sync.transports.base import Mark, Transport
from weight_sync.transports.disk import DiskTransport, PostWrite
from weight_sync.transports.distributed import DistributedTransport
from weight_sync.transports.tensor import TensorTransport


def make_transport(settings: WeightSyncSettings, mark: Mark, post_write: PostWrite | None = None,
                   auto_format: bool = False) -> Transport:
    """The transport of ``settings.transport`` (resolved: not ``auto``). ``post_write``: the disk
    transport's hook; ``auto_format``: the load format was ``auto`` (the tensor transport falls back
    from ``mapped`` to flattened buckets where an engine does not allow its loader)."""
    if settings.transport == "distributed":
        return DistributedTransport(settings, mark)
    if settings.transport == "tensor":
        return TensorTransport(settings, mark, auto_format)
    if settings.transport == "disk":
        return DiskTransport(settings, mark, post_write)
    raise ValueError(f"transport {settings.transport!r}: expected distributed, tensor or disk")
