"""SGLang's ``POST /update_weights_from_tensor``: building its request body, and reading one.

The body is SGLang's ``UpdateWeightsFromTensorReqInput`` (``srt/managers/io_struct.py``):

- ``serialized_named_tensors``: one base64 string per TP rank of the engine; TP rank r reads
  entry r alone (SGLang's ``deserialize_own_rank``). Each is torch's ``ForkingPickler`` output of
  - ``load_format`` null: a list of ``(name, tensor)`` pairs, or
  - ``load_format`` ``"flattened_bucket"``: ``{"flattened_tensor": t, "metadata": [m, ...]}``, ``t``
    a 1-D ``uint8`` tensor, each ``m`` with the attributes ``name, shape, dtype, start_idx, end_idx,
    numel`` (byte offsets into ``t``; ``numel`` is the byte count); SGLang rebuilds each tensor as
    ``t[start_idx:end_idx].view(dtype).reshape(shape)`` (its ``FlattenedTensorBucket``).
- ``load_format`` may also name a function on the engine's ``--custom-weight-loader`` list
  (SGLang imports it and calls ``fn(model, named_tensors)`` with the pairs of a list payload;
  ``sglang_protocol.held_weights``); an engine refuses one not on its list.
- ``load_format``, ``flush_cache`` (SGLang's default is true: sent false on all but a version's
  last bucket), ``weight_version`` (applied once the call has succeeded).

What travels is a handle, never the bytes: a CUDA tensor as a CUDA IPC handle of the allocation
that holds it (the receiver maps the sender's memory), a CPU tensor as the name of a shared-memory
file (torch's ``file_system`` sharing: unlike its default ``file_descriptor`` sharing, it needs no
connection back to the sender, which only a child process could make). A CPU tensor given to
``serialize`` is moved into shared memory in place, as torch.multiprocessing does; the sender
stages buckets in ``shared_cpu_buffer``\\ s instead of handing it the trainer's tensors.

Devices: torch names a CUDA tensor's device by its index in the sending process, which another
process with other ``CUDA_VISIBLE_DEVICES`` would map to another GPU. As SGLang's own senders do
(``monkey_patch_torch_reductions``), ``serialize`` replaces the index by the device's UUID; SGLang's
receiver maps it back to its own index, and so does ``deserialize`` here.

What SGLang accepts: its receiver unpickles with an allowlist (``SafeUnpickler``). The payloads
built here use only names on it: torch's rebuild functions, tensor and storage classes and dtypes,
builtins, and ``types.SimpleNamespace`` for the metadata entries (SGLang reads them by attribute).
``deserialize`` here is restricted the same way.

Lifetimes: a handle does not keep memory alive; the sender keeps the tensors until the engine has
answered (the engine has copied them by then). Each serialisation takes one reference that the
receiving rank gives back when it deserialises and frees its tensors, so every TP rank gets its
own serialisation and each is read once; one never read keeps its memory (CUDA) or shared-memory
file (CPU) referenced until the sender exits.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import collections
import io
import math
import pickle
import types
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reducers with ForkingPickler)
from multiprocessing.reduction import ForkingPickler
from torch.multiprocessing import reductions

from sglang_protocol.buckets import bucket_layout

ROUTE = "/update_weights_from_tensor"
FLATTENED = "flattened_bucket"
LOAD_FORMATS = (None, FLATTENED)  # SGLang's built-in formats besides "direct"; or a custom loader's path
# Position of the device in torch's ``rebuild_cuda_tensor`` arguments (stable for years; SGLang
# patches the same position). ``_reduce_tensor`` checks it holds the tensor's device index.
_CUDA_DEVICE_ARG = 6


# --- sending --------------------------------------------------------------------------------------
def shared_cpu_buffer(nbytes: int) -> torch.Tensor:
    """A 1-D ``uint8`` CPU tensor in a named shared-memory file, for staging CPU buckets
    (``serialize`` then sends its name, without moving it)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)  # [nbytes]
    if nbytes:
        buf.untyped_storage()._share_filename_cpu_()
    return buf


def flattened_bucket(names: Sequence[str], flat: torch.Tensor, dtypes: Sequence[torch.dtype],
                     shapes: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The ``"flattened_bucket"`` object for ``flat`` (the tensors' bytes concatenated in
    ``names`` order, ``sglang_protocol.buckets.flatten_bucket``). ValueError if they do not fit."""
    if flat.dim() != 1 or flat.dtype != torch.uint8:
        raise ValueError(f"flattened_tensor: expected a 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    layout = bucket_layout(dtypes, shapes)
    total = layout[-1][0] + layout[-1][1] if layout else 0
    if total != flat.numel() or len(names) != len(layout):
        raise ValueError(f"flattened_tensor: {len(names)} tensors of {total} bytes, the bucket has {flat.numel()}")
    metadata = [types.SimpleNamespace(name=n, shape=torch.Size(int(d) for d in sh), dtype=dt, start_idx=o,
                                      end_idx=o + size, numel=size)
                for n, dt, sh, (o, size) in zip(names, dtypes, shapes, layout)]
    return {"flattened_tensor": flat, "metadata": metadata}


def serialize(obj: Any, device_by_uuid: bool = True) -> str:
    """``obj`` as one entry of ``serialized_named_tensors``: base64 of torch's ForkingPickler
    output, CUDA devices named by UUID and CPU storages by shared-memory file name.
    ``device_by_uuid=False``: CUDA devices by index, torch's own form, for a receiver that
    deserializes without SGLang's UUID patch (``lora_adapter.cuda_device_by_uuid``); the index
    must then mean the same GPU in both processes."""
    buf = io.BytesIO()
    _Pickler(buf, device_by_uuid).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def request_body(obj: Any, tp_size: int, load_format: str | None, flush_cache: bool,
                 weight_version: str | None = None) -> dict[str, Any]:
    """The JSON body of ``/update_weights_from_tensor`` for an engine of ``tp_size`` TP ranks:
    ``obj`` (a list of ``(name, tensor)`` or a ``flattened_bucket``) serialised once per rank.
    ``load_format``: one of ``LOAD_FORMATS`` or a custom loader's import path (with a list)."""
    if load_format not in LOAD_FORMATS and not _is_loader_path(load_format):
        raise ValueError(f"load_format {load_format!r}: expected one of {LOAD_FORMATS} or a loader's import path")
    if tp_size < 1:
        raise ValueError(f"tp_size {tp_size}: must be >= 1")
    body: dict[str, Any] = {"serialized_named_tensors": [serialize(obj) for _ in range(tp_size)],
                            "load_format": load_format, "flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


class _Pickler(ForkingPickler):
    """ForkingPickler with torch's reducers, except: CUDA devices by UUID (unless told not to), CPU
    storages by file name."""

    def __init__(self, file: io.BytesIO, device_by_uuid: bool = True):
        super().__init__(file)
        reduce_tensor = _reduce_tensor if device_by_uuid else _reduce_tensor_by_index
        self.dispatch_table[torch.Tensor] = reduce_tensor
        self.dispatch_table[torch.nn.Parameter] = reduce_tensor
        self.dispatch_table[torch.UntypedStorage] = _reduce_storage


def _reduce_tensor(t: torch.Tensor):
    fn, args = reductions.reduce_tensor(t)
    if t.is_cuda and isinstance(args[_CUDA_DEVICE_ARG], int):  # (SGLang's patch, if loaded, gives a UUID)
        if args[_CUDA_DEVICE_ARG] != t.device.index:
            raise RuntimeError("torch's CUDA tensor reduction changed its arguments: the device is not at "
                               f"position {_CUDA_DEVICE_ARG}")
        uuid = str(torch.cuda.get_device_properties(t.device.index).uuid)
        args = (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1:])
    return fn, args


def _reduce_tensor_by_index(t: torch.Tensor):
    fn, args = reductions.reduce_tensor(t)
    if t.is_cuda and not isinstance(args[_CUDA_DEVICE_ARG], int):  # SGLang's patch is loaded in this process
        args = (*args[:_CUDA_DEVICE_ARG], t.device.index, *args[_CUDA_DEVICE_ARG + 1:])
    return fn, args


def _reduce_storage(storage: torch.UntypedStorage):
    if storage.device.type != "cpu" or storage.nbytes() == 0:
        return reductions.reduce_storage(storage)
    manager, handle, size = storage._share_filename_cpu_()  # already shared: its existing name
    storage._shared_incref()  # the receiver's rebuild gives this reference back
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


# --- receiving ------------------------------------------------------------------------------------
@dataclass
class TensorUpdateRequest:
    """A parsed ``/update_weights_from_tensor`` body (the fields the embedded engine uses)."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    weight_version: str | None = None
    abort_all_requests: bool = False


def parse_request(body: dict) -> TensorUpdateRequest:
    """Check the body's fields and types (ValueError naming the field)."""
    payloads = body.get("serialized_named_tensors")
    if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
        raise ValueError("serialized_named_tensors: expected a non-empty list of base64 strings, one per TP rank")
    load_format = body.get("load_format")
    if load_format not in LOAD_FORMATS and not _is_loader_path(load_format):
        raise ValueError(f"load_format: {load_format!r} is not supported (null, {FLATTENED!r} or the import path "
                         "of a --custom-weight-loader)")
    flags = {k: body.get(k, d) for k, d in (("flush_cache", True), ("abort_all_requests", False))}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise ValueError(f"{k}: expected a boolean, got {v!r}")
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise ValueError(f"weight_version: expected a string, got {version!r}")
    return TensorUpdateRequest(payloads, load_format, flags["flush_cache"], version, flags["abort_all_requests"])


def _is_loader_path(load_format: Any) -> bool:
    """A dotted import path (``module.function``), as SGLang's ``dynamic_import`` reads one."""
    return isinstance(load_format, str) and "." in load_format.strip(".") and " " not in load_format


def deserialize(payload: str | bytes) -> Any:
    """One ``serialized_named_tensors`` entry back to its object (CUDA handles opened on the
    local device with the sent UUID). Only torch's tensor-sharing names and plain data types may
    appear in the pickle (pickle.UnpicklingError otherwise)."""
    try:
        data = base64.b64decode(payload, validate=True) if isinstance(payload, str) else bytes(payload)
    except (binascii.Error, ValueError) as e:
        raise pickle.UnpicklingError(f"not base64: {e}") from e
    return _Unpickler(io.BytesIO(data)).load()


def named_tensors(obj: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of a deserialised payload (views into a flattened bucket);
    ValueError saying what does not fit ``load_format``. A custom loader's list may be empty
    (``held_weights``: let go of what is held)."""
    if load_format == FLATTENED:
        if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= set(obj):
            raise ValueError("a flattened bucket must be a dict with 'flattened_tensor' and 'metadata'")
        flat, meta = obj["flattened_tensor"], obj["metadata"]
        if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.dtype != torch.uint8:
            raise ValueError("flattened_tensor: expected a 1-D uint8 tensor")
        if not isinstance(meta, (list, tuple)) or not meta:
            raise ValueError("metadata: expected a non-empty list")
        return [_view(flat, m, i) for i, m in enumerate(meta)]
    if not isinstance(obj, (list, tuple)) or not (obj or load_format not in LOAD_FORMATS):
        raise ValueError("expected a non-empty list of (name, tensor) pairs")
    out = []
    for i, pair in enumerate(obj):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise ValueError(f"entry {i}: expected a (name, tensor) pair")
        out.append((pair[0], pair[1]))
    return out


def _view(flat: torch.Tensor, m: Any, i: int) -> tuple[str, torch.Tensor]:
    """Tensor ``i`` of a flattened bucket, checked against the bucket's bounds and alignment."""
    try:
        name, dtype, start, end = m.name, m.dtype, int(m.start_idx), int(m.end_idx)
        shape = tuple(int(d) for d in m.shape)
    except (AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"metadata[{i}]: expected name, shape, dtype, start_idx, end_idx ({e})") from e
    if not isinstance(name, str) or not isinstance(dtype, torch.dtype) or any(d < 0 for d in shape):
        raise ValueError(f"metadata[{i}]: a str name, a torch dtype and a shape without negative dimensions")
    if not 0 <= start <= end <= flat.numel() or end - start != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"metadata[{i}] ({name}): bytes [{start}, {end}) do not hold {dtype} {list(shape)} "
                         f"inside a bucket of {flat.numel()} bytes")
    if start % dtype.itemsize:
        raise ValueError(f"metadata[{i}] ({name}): byte offset {start} is not aligned to {dtype}")
    return name, flat[start:end].view(dtype).reshape(shape)


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's ``rebuild_cuda_tensor`` with the device given by UUID (or by index)."""
    dev = args[_CUDA_DEVICE_ARG]
    if isinstance(dev, str):
        found = [i for i in range(torch.cuda.device_count())
                 if str(torch.cuda.get_device_properties(i).uuid) == dev]
        if not found:
            raise pickle.UnpicklingError(f"the tensor lives on GPU {dev}, which this process does not see")
        args = (*args[:_CUDA_DEVICE_ARG], found[0], *args[_CUDA_DEVICE_ARG + 1:])
    return reductions.rebuild_cuda_tensor(*args)


def _allowed_globals() -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {
        ("builtins", n): getattr(builtins, n)
        for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list", "range",
                  "set", "slice", "str", "tuple")}
    out[("collections", "OrderedDict")] = collections.OrderedDict
    out[("types", "SimpleNamespace")] = types.SimpleNamespace
    out.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    for cls in (torch.Tensor, torch.Size, torch.device, torch.nn.Parameter, torch.UntypedStorage,
                torch.TypedStorage, *torch._storage_classes):
        out[(cls.__module__, cls.__name__)] = cls
    for n in ("rebuild_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child", "rebuild_storage_filename",
              "rebuild_storage_fd", "rebuild_storage_empty"):
        out[("torch.multiprocessing.reductions", n)] = getattr(reductions, n)
    from multiprocessing import resource_sharer  # torch's default CPU sharing (file descriptors)

    out[("multiprocessing.resource_sharer", "DupFd")] = resource_sharer.DupFd
    # CUDA handles, from torch's reducer or from a sender that loaded SGLang's patch of it
    out[("torch.multiprocessing.reductions", "rebuild_cuda_tensor")] = _rebuild_cuda_tensor
    out[("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")] = _rebuild_cuda_tensor
    # metadata entries built by SGLang's FlattenedTensorBucket (a dataclass): read by attribute
    out[("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")] = types.SimpleNamespace
    return out


class _Unpickler(pickle.Unpickler):
    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _Unpickler._allowed is None:
            _Unpickler._allowed = _allowed_globals()
        try:
            return _Unpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a tensor payload") from None
