"""A weight loader for SGLang's ``--custom-weight-loader`` that keeps what it is sent mapped.

Colocated (trainer and engines on one GPU), weights reach an engine as CUDA IPC handles to the
trainer's memory (``/update_weights_from_tensor``). The receiver rebuilds each tensor from its
handle; torch opens the handle (``cudaIpcOpenMemHandle``) unless the same allocation is still
mapped in that process, and closes it once the last tensor over it is freed. SGLang's own loaders
free the tensors after copying them, so every push opens every handle again, which costs far more
than the copy behind it.

A trainer's parameters stay put between pushes (optimizers update them in place), so their handles
are the same at every push. :func:`load_and_hold` loads like SGLang's default path
(``model.load_weights``) and then holds the tensors it was given until the next call: at the next
push torch finds each allocation still mapped and opens nothing. And since the same bytes land in
the same parameters at every push, the first load is recorded and later pushes replay its copies
in a few batched kernels instead of walking the model again (``load_replay``).

What travels (:func:`pack`, read back by :func:`unpack`): one pair per *storage*, not per tensor.
Each CUDA tensor sent costs both processes a fixed amount of work (an IPC event and a reference
counter), however small it is, so tensors that share a storage (a trainer whose parameters live
in one buffer per dtype: one pair for the whole model) go as that storage's bytes (a 1-D ``uint8``
tensor over all of it) under the name ``HEADER + json``, the json listing each tensor's name,
dtype, shape and byte offset. SGLang only requires ``(str, tensor)`` pairs of a custom loader's
payload; this loader is the only reader of the name.

How it is switched on (``--update-weight-load-format mapped``): every engine runs with
``--custom-weight-loader sglang_protocol.held_weights.load_and_hold`` (SGLang checks that a request's
``load_format`` is on that list before importing it; the embedded engine does the same), and the
sender sends ``load_format`` :data:`LOADER` with the trainer's parameters themselves.

Lifetimes: a held tensor keeps the trainer's allocation alive (the trainer's caching allocator
cannot reuse a block another process holds). Only storage that lives as long as the trainer's
model may be sent this way; the sender sends an empty list when it closes, which lets go of
everything held.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Iterable

import torch

from sglang_protocol import delta_weights, load_replay
from sglang_protocol.buckets import dtype_name, parse_dtype

logger = logging.getLogger(__name__)
# What the server's log says of a model's first held load; bench/weight_sync_colocated.py reads it back
REPLAYED = "later pushes replay them"
NOT_REPLAYED = "held weights: pushes walk load_weights, none is replayed"

LOADER = "sglang_protocol.held_weights.load_and_hold"
HEADER = "reservoir.held:"

# per model (one per engine process and TP rank): the tensors of the last push, and the signature
# of the storages last recorded with their plan (None: that load cannot be replayed)
_held: dict[int, list[Any]] = {}
_loads: dict[int, tuple[tuple, load_replay.Plan | None]] = {}


def load_and_hold(model: Any, named_tensors: Iterable[tuple[str, Any]]) -> None:
    """SGLang's custom weight loader contract, ``fn(model, named_tensors)``: load ``named_tensors``
    with ``model.load_weights`` (SGLang's own loading: stacked projections, TP sharding, casts) and
    hold them until the next call, so their allocations stay mapped. The first load of a set of
    storages is recorded (``load_replay``); a later push of the same storages into the same
    parameters replays the recorded copies instead of walking the model again. An empty list lets
    go of what is held. The one-entry request ``delta_weights.INSTALL`` arms delta pushes instead
    (``delta_weights.install``): the trainer sends it with ``--update-weight-mode delta``."""
    named = list(named_tensors)
    if len(named) == 1 and named[0][0] == delta_weights.INSTALL:
        delta_weights.install(model)
        return
    if not named:
        _held.pop(id(model), None)
        _loads.pop(id(model), None)
        return
    if not isinstance(model, torch.nn.Module):  # a stand-in with load_weights alone (the embedded engine's)
        model.load_weights(unpack(named))
        _held[id(model)] = [t for _, t in named]
        return
    sig = load_replay.signature(named, load_replay.model_tensors(model))
    known = _loads.get(id(model))
    if known is not None and known[0] == sig:
        plan = known[1]
        if plan is not None:
            plan.replay()
        else:  # recorded once already: this load cannot be replayed
            model.load_weights(unpack(named))
    else:
        plan, why = load_replay.record(model, named, lambda: model.load_weights(unpack(named)))
        _loads[id(model)] = (sig, plan)
        if plan is None:
            logger.warning(f"{NOT_REPLAYED}: %s", why)
        else:
            logger.info(f"held weights: recorded %d copies in %d steps; {REPLAYED}", plan.num_copies, len(plan.steps))
    _held[id(model)] = [t for _, t in named]  # replaces the last push's: same allocations, still mapped


def plan_of(model: Any) -> load_replay.Plan | None:
    """The recorded load that pushes into ``model`` replay (None without one)."""
    return _loads.get(id(model), (None, None))[1]


def replays(model: Any) -> int:
    """How many pushes into ``model`` replayed a recorded load (0 without a plan)."""
    plan = plan_of(model)
    return plan.replays if plan is not None else 0


def pack(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The pairs to send for ``named`` (contiguous tensors): one per storage, its whole bytes as a
    1-D ``uint8`` tensor, named ``HEADER`` + the json of its tensors ``[name, dtype, shape, byte
    offset, position in named]``. ValueError for a tensor that is not contiguous."""
    groups: dict[int, tuple[torch.UntypedStorage, list]] = {}
    for i, (name, t) in enumerate(named):
        if not t.is_contiguous():
            raise ValueError(f"{name}: held tensors must be contiguous")
        st = t.untyped_storage()
        entry = [name, dtype_name(t.dtype), list(t.shape), t.storage_offset() * t.element_size(), i]
        groups.setdefault(st.data_ptr(), (st, []))[1].append(entry)
    out = []
    for st, entries in groups.values():
        whole = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)  # [storage bytes]
        out.append((HEADER + json.dumps(entries, separators=(",", ":")), whole))
    return out


def unpack(pairs: Iterable[tuple[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs back from :func:`pack`'s (views into the received storages), in the
    order they were packed (loaders may rely on it, e.g. to stack q/k/v); other pairs pass as they
    are, after those. ValueError naming what does not fit."""
    out, plain = [], []
    for name, t in pairs:
        if not name.startswith(HEADER):
            plain.append((name, t))
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.uint8:
            raise ValueError(f"{name[:60]}...: expected a 1-D uint8 tensor of a storage's bytes")
        try:
            entries = json.loads(name[len(HEADER):])
            typed: dict[torch.dtype, torch.Tensor] = {}  # the storage as each dtype (whole elements)
            for n, dtype_str, shape, offset, position in entries:
                try:
                    dtype = parse_dtype(dtype_str)
                except ValueError as e:
                    raise ValueError(f"{n}: {e}") from e
                size = dtype.itemsize
                nbytes = math.prod(shape) * size
                if not 0 <= offset <= offset + nbytes <= t.numel() - t.numel() % size or offset % size:
                    raise ValueError(f"{n}: bytes [{offset}, {offset + nbytes}) do not fit a storage of "
                                     f"{t.numel()} bytes aligned to {dtype}")
                if dtype not in typed:
                    typed[dtype] = t[:t.numel() - t.numel() % size].view(dtype)
                out.append((position, n, typed[dtype].as_strided(shape, _contiguous_strides(shape), offset // size)))
        except (TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"a held-weights header that cannot be read: {type(e).__name__}: {e}") from e
    out.sort(key=lambda x: x[0])
    return [(n, v) for _, n, v in out] + plain


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return strides[::-1]
