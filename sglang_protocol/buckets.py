"""SGLang's flattened-bucket format, and the checksums both sides of a push compute.

A *flattened bucket* (``load_format: "flattened_bucket"``) is ONE 1-D ``uint8`` tensor holding
the bucket's tensors' bytes concatenated in ``names`` order; SGLang's receiver allocates it with
``FlattenedTensorBucket.empty(names, dtypes, shapes)`` and views each tensor back out of it. So it
travels as bytes whatever the dtypes, tensors of several dtypes may share a bucket, and each
tensor must start at a byte offset that is a multiple of its element size (SGLang refuses the
bucket otherwise; ``bucket_layout`` applies the same rule).

``tensor_checksum`` is how both sides fingerprint a tensor for ``--check-weight-update-equal``:
the sha256 of its raw bytes (after an optional cast), so equality is exact, not approximate.
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

import torch


def bucket_layout(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """``(byte offset, byte size)`` of each tensor in a flattened bucket (ValueError, naming the
    tensor's index, for a negative dimension or a misaligned offset, as SGLang refuses them)."""
    out, offset = [], 0
    for i, (dt, sh) in enumerate(zip(dtypes, shapes, strict=True)):
        if any(int(d) < 0 for d in sh):
            raise ValueError(f"tensor {i}: negative dimension in shape {list(sh)}")
        if offset % dt.itemsize:
            raise ValueError(f"tensor {i}: byte offset {offset} is not aligned to its dtype {dt}")
        size = math.prod(int(d) for d in sh) * dt.itemsize
        out.append((offset, size))
        offset += size
    return out


def flatten_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes concatenated into one 1-D ``uint8`` tensor (all on one device)."""
    if not tensors:
        raise ValueError("flatten_bucket: empty bucket")
    bucket_layout([t.dtype for t in tensors], [t.shape for t in tensors])
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])  # [bytes]


def unflatten_bucket(flat: torch.Tensor, dtypes: Sequence[torch.dtype],
                     shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Split a flattened ``uint8`` bucket back into tensors of ``dtypes`` and ``shapes`` (views)."""
    if flat.dim() != 1 or flat.dtype != torch.uint8:
        raise ValueError(f"unflatten_bucket: expected a 1-D uint8 tensor, got {flat.dtype} of shape {tuple(flat.shape)}")
    layout = bucket_layout(dtypes, shapes)
    total = layout[-1][0] + layout[-1][1] if layout else 0
    if total != flat.numel():
        raise ValueError(f"unflatten_bucket: dtypes and shapes hold {total} bytes, the bucket has {flat.numel()}")
    return [flat[o:o + n].view(dt).view(tuple(int(d) for d in sh))
            for (o, n), dt, sh in zip(layout, dtypes, shapes)]


def bucket_nbytes(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> int:
    """Size in bytes of a flattened bucket holding tensors of ``dtypes`` and ``shapes``."""
    layout = bucket_layout(dtypes, shapes)
    return layout[-1][0] + layout[-1][1] if layout else 0


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
