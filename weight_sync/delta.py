"""The trainer's side of delta pushes (``--update-weight-mode delta``): the last pushed copy of
every bucket, in the engines' dtype, and per push the choice between a full and a delta push.

A push is full when there is no copy to diff against (the first push, after a failed push or a
resync), every ``full_every`` pushes, when the buckets are not those of the copy, and when an
engine is not at the version the copy is of (``/get_weight_version``: a restarted engine serves
its checkpoint, a new one something else). Otherwise each bucket travels as its delta
(``sglang_protocol/delta_weights.py``: one ``uint8`` tensor named with a header), and the copy is
brought to the new values as the bucket is encoded.

Memory: the copy is one more copy of the model in the engines' dtype (2 bytes a parameter for
bf16), kept on the device the buckets are packed on (the trainer's GPU over NCCL, host memory
over gloo and for the disk transport).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import torch

from sglang_protocol import delta_weights, held_weights
from sglang_protocol.buckets import parse_dtype
from weight_sync.engines import EngineState
from weight_sync.interfaces import TensorSpec, WeightSyncSettings
from weight_sync.link import send_tensor_bucket
from weight_sync.plan import Bucket

logger = logging.getLogger(__name__)


class DeltaTracker:
    """The last pushed copy, per bucket index: ``(names, flat uint8 copy)``, and what the current
    push is (``delta``: True for a delta push; ``wire[i]``: bucket i's header as it travels)."""

    def __init__(self, settings: WeightSyncSettings):
        self.settings = settings
        self._base: dict[int, tuple[tuple[str, ...], torch.Tensor]] = {}
        self.base_version: int | None = None
        self._since_full = 0
        self.delta = False
        self.reason = "no push yet"
        self.wire: dict[int, Bucket] = {}
        self.sent_bytes = 0  # what the current push put on the wire
        self.push_id = ""

    async def choose(self, members: list[EngineState], buckets: list[Bucket]) -> bool:
        """Decide whether this push goes as a delta (True) or in full, asking each member its
        weight version if a delta is possible; a full push says why in the log."""
        reason = self._full_reason(buckets)
        if reason is None:
            seen = await asyncio.gather(*(e.client.get_weight_version() for e in members), return_exceptions=True)
            off = [e.url for e, v in zip(members, seen)
                   if isinstance(v, BaseException) or str(v) != str(self.base_version) or e.version != self.base_version]
            if off:
                reason = f"engines {off} are not at v{self.base_version}, the version the trainer's copy is of"
        self.delta, self.reason = reason is None, reason or "delta"
        if reason is not None:
            logger.info("weight push in full: %s", reason)
        self.wire, self.sent_bytes, self.push_id = {}, 0, uuid.uuid4().hex[:12]
        return self.delta

    def _full_reason(self, buckets: list[Bucket]) -> str | None:
        every = self.settings.full_every
        if self.base_version is None:
            return "no pushed copy to diff against (first push, or after a failed push or a resync)"
        if every and self._since_full + 1 >= every:
            return f"every {every}th push is full (--update-weight-full-every)"
        if len(buckets) != len(self._base) or any(
                self._base.get(i, ((),))[0] != tuple(s.name for s in b.specs) for i, b in enumerate(buckets)):
            return "the push's buckets are not those of the last push"
        return None

    def encode(self, i: int, bucket: Bucket, flat: torch.Tensor) -> torch.Tensor:
        """What travels for bucket ``i`` (``flat``: its packed bytes, ``uint8``): ``flat`` itself in
        a full push, else its delta (its header in ``wire[i]``). Either way the copy is brought to
        ``flat``. Runs where the bucket is packed (a worker thread on the CPU)."""
        names = tuple(s.name for s in bucket.specs)
        kept = self._base.get(i)
        if not self.delta:
            if kept is not None and kept[0] == names and kept[1].numel() == flat.numel():
                kept[1].copy_(flat)
            else:
                self._base[i] = (names, flat.detach().clone())
            self.sent_bytes += flat.numel()
            return flat
        assert kept is not None and kept[1].numel() == flat.numel(), "choose() checked the buckets"
        dtype = parse_dtype(bucket.dtype)
        new, old = delta_weights.bits(flat.view(dtype)), delta_weights.bits(kept[1].view(dtype))
        payload, n = delta_weights.encode(new, old, self.settings.delta_encoding)
        if payload.numel() == 0:  # nothing changed (overwrite): a collective of 0 bytes is not sent
            payload = torch.zeros(1, dtype=torch.uint8)
        kept[1].copy_(flat)
        meta = {"names": list(names), "shapes": [list(s.shape) for s in bucket.specs], "dtype": bucket.dtype,
                "n": n, "enc": self.settings.delta_encoding, "base": str(self.base_version),
                "push": self.push_id}
        self.wire[i] = Bucket("uint8", [], [TensorSpec(delta_weights.header(meta), (payload.numel(),), "uint8")])
        self.sent_bytes += payload.numel()
        return payload.to(flat.device)

    def commit(self, version: int) -> None:
        """Every member received ``version`` and the copy holds it."""
        self.base_version = version
        self._since_full = self._since_full + 1 if self.delta else 0

    def invalidate(self, why: str) -> None:
        """The engines may not hold the copy's values: the next push is full."""
        if self.base_version is not None:
            logger.info("weight push: the next push is full (%s)", why)
        self.base_version = None

    def metrics(self) -> dict[str, float]:
        """``weight_sync/delta``: 1 for a delta push; ``weight_sync/sent_bytes``: what travelled."""
        return {"weight_sync/delta": float(self.delta), "weight_sync/sent_bytes": float(self.sent_bytes)}


async def arm_sglang(members: list[EngineState], settings: WeightSyncSettings) -> None:
    """Arm delta loads on the members that do not list their parameters (SGLang servers): the
    held-weights loader, which engines a run starts allow (``--custom-weight-loader``), gets the
    one-entry request ``delta_weights.INSTALL`` (an empty tensor: it pickles by value, so this works
    across hosts) and wraps the model's ``load_weights`` (``delta_weights.install``). Must run
    inside a weight-update session, before the full push that the deltas will be taken against."""
    sglang = [e for e in members if not e.complete]
    if not sglang:  # the embedded engine applies deltas itself
        return
    await send_tensor_bucket(held_weights.LOADER, [(e.url, e.gpus, e.client) for e in sglang],
                             [(delta_weights.INSTALL, torch.empty(0, dtype=torch.uint8))], settings, None, False)
