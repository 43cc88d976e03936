"""Lossless conversion between Samples (and groups) and Arrow record batches / Parquet files.

This is the on-disk format of buffer snapshots, debug rollout dumps and standalone rollout
output. Ragged fields (tokens, loss masks, log-probs, weight versions) are Arrow list columns
built from numpy buffers (no per-element Python work); polymorphic fields (prompt, label,
metadata, dict rewards) are JSON strings so any JSON value round-trips, unicode included.
slime's other Sample fields and the attributes plugins add go into one JSON column, ``extra``,
holding only what differs from the defaults (null for most samples); values that JSON cannot hold
(tensors become lists first) are left out. Files written before that column existed still read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from buffer.sample import SAMPLE_FIELDS, PrefixCacheInfo, Sample, SpecInfo, Status

SCHEMA = pa.schema([
    ("group", pa.int64()),  # position of the sample's group in this batch/file
    ("group_index", pa.int64()),
    ("index", pa.int64()),
    ("prompt", pa.string()),  # JSON
    ("label", pa.string()),  # JSON
    ("metadata", pa.string()),  # JSON
    ("tokens", pa.list_(pa.int64())),
    ("response", pa.string()),
    ("response_length", pa.int64()),
    ("loss_mask", pa.list_(pa.int32())),
    ("rollout_log_probs", pa.list_(pa.float64())),
    ("reward", pa.float64()),  # scalar rewards
    ("reward_dict", pa.string()),  # JSON, for dict rewards
    ("status", pa.string()),
    ("weight_versions", pa.list_(pa.int64())),
    ("extra", pa.string()),  # JSON: slime's other fields and plugin attributes that are not defaults
])
_OPTIONAL = {"extra"}  # absent from files written before it existed
_BASE_FIELDS = {"group_index", "index", "prompt", "label", "metadata", "tokens", "response", "response_length",
                "loss_mask", "rollout_log_probs", "reward", "status", "weight_versions"}
_DEFAULTS = Sample()
# slime's fields beyond the base columns, with their defaults (checked per sample: keep it cheap)
_EXTRA_FIELDS = tuple((k, getattr(_DEFAULTS, k)) for k in SAMPLE_FIELDS - _BASE_FIELDS)


def _dumps(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False)


def _ragged(values: list[list | None], dtype: np.dtype, arrow_type: pa.DataType) -> pa.Array:
    """Build a list<arrow_type> array from Python lists (None -> null) via one numpy concat."""
    lengths = np.fromiter((0 if v is None else len(v) for v in values), dtype=np.int32, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    present = [np.asarray(v, dtype=dtype) for v in values if v]
    flat = np.concatenate(present) if present else np.zeros(0, dtype=dtype)
    mask = np.fromiter((v is None for v in values), dtype=bool, count=len(values))
    offs = pa.array(offsets, type=pa.int32(), mask=np.append(mask, False) if mask.any() else None)
    return pa.ListArray.from_arrays(offs, pa.array(flat, type=arrow_type))


def _extra(s: Sample) -> str | None:
    """JSON of the fields beyond the base columns that differ from their defaults (and of the
    attributes a plugin added), or None."""
    d = vars(s)
    changed = [k for k, default in _EXTRA_FIELDS if d[k] is not default and d[k] != default]
    if len(d) > len(SAMPLE_FIELDS):
        changed += [k for k in d if k not in SAMPLE_FIELDS]
    if not changed:
        return None
    out = {}
    for k in changed:
        v = d[k]
        if k in ("spec_info", "prefix_cache_info"):
            v = v.to_dict()
        try:
            out[k] = json.loads(json.dumps(_plain(v), ensure_ascii=False))
        except (TypeError, ValueError):  # not JSON (an object of the plugin's): not persisted
            continue
    return _dumps(out) if out else None


def _plain(v: Any) -> Any:
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        return v.tolist()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def groups_to_record_batch(groups: list[list[Sample]]) -> pa.RecordBatch:
    """Convert groups of samples to one record batch (column ``group`` keeps the grouping)."""
    samples = [s for g in groups for s in g]
    group_pos = [gi for gi, g in enumerate(groups) for _ in g]
    scalar = [None if isinstance(s.reward, dict) else s.reward for s in samples]
    cols = {
        "group": pa.array(group_pos, type=pa.int64()),
        "group_index": pa.array([s.group_index for s in samples], type=pa.int64()),
        "index": pa.array([s.index for s in samples], type=pa.int64()),
        "prompt": pa.array([_dumps(s.prompt) for s in samples], type=pa.string()),
        "label": pa.array([_dumps(s.label) for s in samples], type=pa.string()),
        "metadata": pa.array([_dumps(s.metadata) for s in samples], type=pa.string()),
        "tokens": _ragged([s.tokens for s in samples], np.int64, pa.int64()),
        "response": pa.array([s.response for s in samples], type=pa.string()),
        "response_length": pa.array([s.response_length for s in samples], type=pa.int64()),
        "loss_mask": _ragged([s.loss_mask for s in samples], np.int32, pa.int32()),
        "rollout_log_probs": _ragged([s.rollout_log_probs for s in samples], np.float64, pa.float64()),
        "reward": pa.array(scalar, type=pa.float64()),
        "reward_dict": pa.array([_dumps(s.reward) if isinstance(s.reward, dict) else None for s in samples],
                                type=pa.string()),
        "status": pa.array([Status(s.status).value for s in samples], type=pa.string()),
        "weight_versions": _ragged([s.weight_versions for s in samples], np.int64, pa.int64()),
        "extra": pa.array([_extra(s) for s in samples], type=pa.string()),
    }
    return pa.RecordBatch.from_pydict(cols, schema=SCHEMA)


def _unragged(col: pa.Array) -> list[list | None]:
    """Inverse of ``_ragged``: slice one flat numpy buffer per row (fast for long rows)."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = col.offsets.to_numpy()
    flat = col.values.to_numpy(zero_copy_only=False).tolist()
    valid = col.is_valid().to_numpy(zero_copy_only=False)
    return [flat[offsets[i]:offsets[i + 1]] if valid[i] else None for i in range(len(col))]


def record_batch_to_groups(batch: pa.RecordBatch | pa.Table) -> list[list[Sample]]:
    """Convert a record batch (or table) written by ``groups_to_record_batch`` back to groups."""
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks()
    missing = [n for n in SCHEMA.names if n not in batch.schema.names and n not in _OPTIONAL]
    if missing:
        raise ValueError(f"not a Reservoir sample table: missing column(s) {missing}")
    get = lambda name: batch.column(name).to_pylist()  # noqa: E731
    tokens, loss_mask = _unragged(batch.column("tokens")), _unragged(batch.column("loss_mask"))
    logps, versions = _unragged(batch.column("rollout_log_probs")), _unragged(batch.column("weight_versions"))
    group, gidx, idx = get("group"), get("group_index"), get("index")
    prompt, label, meta = get("prompt"), get("label"), get("metadata")
    response, rlen, reward, rdict, status = (get("response"), get("response_length"), get("reward"),
                                             get("reward_dict"), get("status"))
    extra = get("extra") if "extra" in batch.schema.names else [None] * batch.num_rows
    groups: list[list[Sample]] = []
    last = None
    for i in range(batch.num_rows):
        s = Sample(group_index=gidx[i], index=idx[i], prompt=json.loads(prompt[i]), label=json.loads(label[i]),
                   metadata=json.loads(meta[i]), tokens=tokens[i] or [], response=response[i],
                   response_length=rlen[i], loss_mask=loss_mask[i], rollout_log_probs=logps[i],
                   reward=json.loads(rdict[i]) if rdict[i] is not None else reward[i],
                   status=Status(status[i]), weight_versions=versions[i] or [])
        if extra[i] is not None:
            for k, v in json.loads(extra[i]).items():
                if k == "spec_info":
                    v = SpecInfo.from_dict(v)
                elif k == "prefix_cache_info":
                    v = PrefixCacheInfo.from_dict(v)
                setattr(s, k, v)
        if group[i] != last:
            groups.append([])
            last = group[i]
        groups[-1].append(s)
    return groups


def write_parquet(groups: list[list[Sample]], path: str | Path) -> int:
    """Write groups to a Parquet file; returns the number of bytes written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_batches([groups_to_record_batch(groups)], schema=SCHEMA), path)
    return path.stat().st_size


def read_parquet(path: str | Path) -> list[list[Sample]]:
    return record_batch_to_groups(pq.read_table(path))


def iter_parquet_groups(paths: Iterable[str | Path]) -> Iterable[list[Sample]]:
    for p in paths:
        yield from read_parquet(p)
