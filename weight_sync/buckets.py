"""Bucket packing and checksums shared by the weight sender (trainer) and receivers (engines).

A *flattened bucket* (``load_format: "flattened_bucket"``) is ONE 1-D tensor of the bucket's
common dtype holding the bucket's tensors' elements concatenated in ``names`` order; the
receiver splits it back with the ``shapes`` sent in the metadata. All tensors of a flattened
bucket share one dtype.

``tensor_checksum`` is how both sides fingerprint a tensor for ``--check-weight-update-equal``:
the sha256 of its raw bytes (after an optional cast), so equality is exact, not approximate.
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

import torch


def flatten_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate the tensors' elements into one 1-D tensor (all must share dtype and device)."""
    if not tensors:
        raise ValueError("flatten_bucket: empty bucket")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"flatten_bucket: tensors of one bucket must share a dtype, got {sorted(map(str, dtypes))}")
    return torch.cat([t.reshape(-1) for t in tensors])  # [sum(numel)]


def unflatten_bucket(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Split a flattened bucket back into tensors of ``shapes`` (views into ``flat``)."""
    if flat.dim() != 1:
        raise ValueError(f"unflatten_bucket: expected a 1-D tensor, got shape {tuple(flat.shape)}")
    sizes = [math.prod(s) for s in shapes]
    if sum(sizes) != flat.numel():
        raise ValueError(f"unflatten_bucket: shapes hold {sum(sizes)} elements, the bucket has {flat.numel()}")
    return [part.view(tuple(s)) for part, s in zip(flat.split(sizes), shapes)]


def bucket_numel(shapes: Sequence[Sequence[int]]) -> int:
    """Number of elements of a flattened bucket holding ``shapes``."""
    return sum(math.prod(s) for s in shapes)


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> torch.bfloat16 (ValueError if not a dtype)."""
    short = name.removeprefix("torch.")
    dt = getattr(torch, short, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> ``"bfloat16"`` (the form sent in ``dtypes``)."""
    return str(dtype).removeprefix("torch.")


def tensor_checksum(t: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """sha256 (hex) of the tensor's raw bytes in C order, after casting to ``dtype`` if given."""
    x = t.detach()
    if dtype is not None and x.dtype != dtype:
        x = x.to(dtype)
    x = x.contiguous().cpu().reshape(-1)  # [numel]
    return hashlib.sha256(x.view(torch.uint8).numpy().tobytes()).hexdigest()
