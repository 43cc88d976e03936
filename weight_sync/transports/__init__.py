"""How weights travel from trainer rank 0 to the engines: one class per transport behind
``transports.base.Transport``, chosen once from the settings by ``make_transport``.

- ``distributed.py``: a weight-update group (NCCL/gloo) and a broadcast per bucket;
- ``tensor.py``: handles to the trainer's buckets (CUDA IPC; shared memory on the CPU) through
  ``/update_weights_from_tensor``, and the ``mapped`` held-weights format (colocated mode);
- ``disk.py``: an HF checkpoint per version and ``/update_weights_from_disk``;
- ``delta.py``: ``--update-weight-mode delta`` over ``distributed`` and ``disk``.
"""

from __future__ import annotations

import dataclasses
import logging

from weight_sync.interfaces import WeightSyncSettings
from weight_sync.transports.base import Mark, Transport
from weight_sync.transports.delta import DeltaDiskTransport, DeltaDistributedTransport
from weight_sync.transports.disk import DiskTransport, PostWrite
from weight_sync.transports.distributed import DistributedTransport
from weight_sync.transports.tensor import TensorTransport

logger = logging.getLogger(__name__)


def make_transport(settings: WeightSyncSettings, mark: Mark, post_write: PostWrite | None = None) -> Transport:
    """The transport of ``settings.transport``, holding a copy of ``settings`` with ``transport`` and
    ``load_format`` resolved (``auto``: the launcher resolves it; used alone, ``distributed``, the one
    that works anywhere). The caller shares that copy (``transport.settings``). ``post_write``: the
    disk transport's hook (ValueError with another transport). A load format given as ``auto`` lets
    the tensor transport fall back from ``mapped`` to flattened buckets where an engine does not
    allow its loader."""
    auto_format = settings.load_format == "auto"
    settings = dataclasses.replace(settings, transport=settings.resolved_transport(),
                                   load_format=settings.resolved_load_format())
    if post_write is not None and settings.transport != "disk":
        raise ValueError(f"post_write (--custom-update-weight-post-write-path) runs after the disk transport "
                         f"writes a version; transport is {settings.transport!r}")
    delta = settings.update_mode == "delta"
    if delta and settings.transport == "tensor":
        logger.warning("--update-weight-mode delta: the tensor transport (colocated) hands the engines handles to "
                       "the trainer's memory, so no bytes travel that a delta would save; pushing in full")
    if settings.transport == "distributed":
        return DeltaDistributedTransport(settings, mark) if delta else DistributedTransport(settings, mark)
    if settings.transport == "tensor":
        return TensorTransport(settings, mark, auto_format)
    if settings.transport == "disk":
        return DeltaDiskTransport(settings, mark, post_write) if delta else DiskTransport(settings, mark, post_write)
    raise ValueError(f"transport {settings.transport!r}: expected distributed, tensor or disk")
