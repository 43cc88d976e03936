"""Delta weight pushes: only the elements that changed since the last push travel.

After a small optimizer step most values of a model in the engines' dtype (bf16) do not change,
so a push can carry, per bucket, the positions of the changed elements and what changed. Both
sides use this module: the trainer encodes (``weight_sync/delta.py`` keeps its last pushed copy),
the engines apply (the embedded engine in place on its parameters; SGLang through
:func:`install`, which wraps the model's ``load_weights``).

Wire form of one bucket: ONE ``uint8`` tensor named ``PREFIX + json(meta)``; meta holds the
bucket's tensors (``names``, ``shapes``, one ``dtype``), ``base`` (the weight version the delta is
taken against: an engine at another version refuses it, and the trainer then pushes in full),
``enc``, ``n`` (changed elements), ``push`` (an id of the push). Element positions count over the bucket's tensors laid end to
end, each tensor's elements in C order. Encodings (slime's names, ``--update-weight-delta-encoding``):

- ``overwrite``: ``n`` positions (int32, little-endian) then the ``n`` new values: applying it
  twice is harmless.
- ``xor``: the gaps between successive positions (int32) and ``new ^ old`` of each changed
  element (the values' bits as integers), each split into byte planes (byte 0 of every element,
  then byte 1, ...: gaps and XORs are small numbers, so the high planes are nearly all zeros),
  compressed with zlib (deflate, level 1). Several times smaller than ``overwrite``; applying it
  needs exactly the base it was taken against, which ``base`` guarantees.

The value bits are compared as integers, so a changed element is one whose bits changed (-0.0
vs 0.0 and NaN payloads included): the engine's copy ends bit-for-bit equal to the trainer's.
"""

from __future__ import annotations

import json
import logging
import zlib
from typing import Any, Callable, Iterable

import torch

from sglang_protocol.buckets import parse_dtype

logger = logging.getLogger(__name__)

PREFIX = "reservoir.delta:"
#: The name of the one entry of the request that arms :func:`install` on an SGLang engine (sent to
#: the held-weights loader, ``sglang_protocol.held_weights.load_and_hold``, which engines allow).
INSTALL = "reservoir.delta.install"
ENCODINGS = ("xor", "overwrite")
#: A directory the disk transport pushes as a delta holds ``DELTA_FILE`` (one ``uint8`` tensor per
#: bucket, named by its header) and this marker file (its content: ``{"base": version}``).
DELTA_MARKER = "reservoir_delta.json"
DELTA_FILE = "model.safetensors"
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ZLIB_LEVEL = 1  # the payload is already sparse: a higher level costs time for a few percent


class DeltaError(ValueError):
    """A delta that cannot be applied here (another base, a malformed header, an unknown tensor)."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened, its elements' bits as a signed integer tensor of the same size (a view)."""
    return t.reshape(-1).view(_INT_OF_SIZE[t.element_size()])


def is_delta(name: str) -> bool:
    """Whether ``name`` is a delta bucket's header."""
    return isinstance(name, str) and name.startswith(PREFIX)


def encode(new: torch.Tensor, old: torch.Tensor, encoding: str) -> tuple[torch.Tensor, int]:
    """The delta that turns ``old`` into ``new`` (two flat integer views of one dtype, see :func:`bits`)
    as ``(uint8 payload on the CPU, changed elements)``."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding {encoding!r}: expected one of {ENCODINGS}")
    changed = new != old  # [elements]
    pos = changed.nonzero().reshape(-1)  # [n] int64
    n = pos.numel()
    if encoding == "overwrite":
        vals = new[pos]
        parts = [pos.to(torch.int32).cpu().view(torch.uint8), vals.cpu().reshape(-1).view(torch.uint8)]
        return torch.cat(parts), n
    gaps = torch.diff(pos, prepend=pos.new_full((1,), -1)).to(torch.int32)  # [n], all >= 1
    xor = torch.bitwise_xor(new[pos], old[pos])  # [n]
    planes = torch.cat([_planes(gaps.cpu()), _planes(xor.cpu())])
    packed = bytearray(zlib.compress(planes.numpy(), _ZLIB_LEVEL))  # zlib reads the array's buffer: no copy
    return torch.frombuffer(packed, dtype=torch.uint8), n


def decode(payload: torch.Tensor, n: int, itemsize: int, encoding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions int64, values)`` of a payload from :func:`encode`; for ``xor`` the values are the
    XOR masks, for ``overwrite`` the new values (both as integers of ``itemsize`` bytes, CPU)."""
    idt = _INT_OF_SIZE[itemsize]
    raw = payload.reshape(-1).cpu()
    if encoding == "overwrite":
        if n == 0:  # sent as one padding byte
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=idt)
        need = n * (4 + itemsize)
        if raw.numel() != need:
            raise DeltaError(f"overwrite payload: {raw.numel()} bytes, {n} changes need {need}")
        pos = raw[:4 * n].view(torch.int32).to(torch.int64)
        return pos, raw[4 * n:].view(idt)
    if encoding != "xor":
        raise DeltaError(f"enc {encoding!r}: expected one of {ENCODINGS}")
    if n == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=idt)
    try:
        planes = torch.frombuffer(bytearray(zlib.decompress(raw.numpy())), dtype=torch.uint8)
    except zlib.error as e:
        raise DeltaError(f"xor payload: {e}") from e
    if planes.numel() != n * (4 + itemsize):
        raise DeltaError(f"xor payload: {planes.numel()} bytes inflated, {n} changes need {n * (4 + itemsize)}")
    gaps = _unplanes(planes[:4 * n], 4, torch.int32)
    pos = torch.cumsum(gaps.to(torch.int64), 0) - 1
    return pos, _unplanes(planes[4 * n:], itemsize, idt)


def header(meta: dict) -> str:
    """A delta bucket's name: ``PREFIX`` + compact json of ``meta``."""
    return PREFIX + json.dumps(meta, separators=(",", ":"))


def parse_header(name: str) -> dict:
    """The meta of a delta bucket's name; DeltaError saying what is wrong."""
    try:
        meta = json.loads(name[len(PREFIX):])
        names, shapes, dtype = meta["names"], meta["shapes"], parse_dtype(meta["dtype"])
        int(meta["n"]), str(meta["enc"]), meta["base"]
    except (KeyError, TypeError, ValueError) as e:
        raise DeltaError(f"a delta header that cannot be read: {type(e).__name__}: {e}") from e
    if len(names) != len(shapes) or not names:
        raise DeltaError("delta header: names and shapes must be non-empty lists of equal length")
    if dtype.itemsize not in _INT_OF_SIZE:
        raise DeltaError(f"delta header: dtype {dtype} cannot be compared bitwise")
    return meta


def apply(meta: dict, payload: torch.Tensor, targets: list[torch.Tensor], skip: set[int] | None = None) -> None:
    """Apply one bucket's delta in place to ``targets`` (the bucket's tensors in ``meta['names']``
    order, contiguous, of its dtype and shapes), except those at the indices in ``skip`` (a storage
    that an earlier name of the push shares: an XOR applied twice undoes itself). DeltaError for
    what does not fit."""
    dtype = parse_dtype(meta["dtype"])
    numels = [int(torch.Size(s).numel()) for s in meta["shapes"]]
    for name, t, k in zip(meta["names"], targets, numels):
        if t.dtype != dtype or t.numel() != k or not t.is_contiguous():
            raise DeltaError(f"{name}: the engine holds {t.dtype} {list(t.shape)}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}; the delta is of {dtype}, {k} elements")
    pos, vals = decode(payload, int(meta["n"]), dtype.itemsize, meta["enc"])
    ends = torch.tensor(numels, dtype=torch.int64).cumsum(0)
    if pos.numel() and (int(pos[-1]) >= int(ends[-1]) or int(pos[0]) < 0):
        raise DeltaError(f"delta positions run past the bucket's {int(ends[-1])} elements")
    cuts = torch.searchsorted(pos, ends).tolist()  # where each tensor's positions end
    start, lo = 0, 0
    with torch.no_grad():
        for j, (t, end, k) in enumerate(zip(targets, cuts, numels)):
            if end > start and not (skip and j in skip):
                flat = bits(t)
                p = (pos[start:end] - lo).to(t.device)
                v = vals[start:end].to(t.device)
                if meta["enc"] == "xor":
                    flat[p] = torch.bitwise_xor(flat[p], v)
                else:
                    flat[p] = v
            start, lo = end, lo + k


def _planes(x: torch.Tensor) -> torch.Tensor:
    """The bytes of integer tensor ``x`` [n], byte plane by byte plane: [itemsize * n] uint8."""
    return x.reshape(-1).view(torch.uint8).view(-1, x.element_size()).t().contiguous().reshape(-1)


def _unplanes(planes: torch.Tensor, itemsize: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`_planes` undone: [itemsize * n] uint8 -> [n] of ``dtype``."""
    return planes.view(itemsize, -1).t().contiguous().view(dtype).reshape(-1)


# --- SGLang: deltas through the model's load_weights ----------------------------------------------

class _Base:
    """What :func:`install` keeps per model: the last full value of every tensor loaded (HF names,
    the dtype it was loaded in, on the CPU; cast to the delta's dtype, the engine's, when the first
    delta of that tensor arrives: the model holds the cast too). Which version it is, the trainer
    checks before it sends a delta (the engine's ``/get_weight_version`` must be the delta's base)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.refused = False  # the last load refused a delta: the next load is SGLang's rollback


_bases: dict[int, _Base] = {}


def install(model: Any) -> bool:
    """Arm deltas on an SGLang model: wrap its ``load_weights`` so that (1) every plain tensor it
    loads is also kept, as the base later deltas apply to (on the CPU: one copy of the model in
    host memory), and (2) a delta bucket (a tensor named ``PREFIX``...) is applied to those copies
    and the resulting full tensors are loaded the model's own way (stacked projections, TP shards).
    SGLang's models are not in HF layout, which is why the base is kept beside them.

    The trainer arms only engines that do not list their parameters (SGLang): the embedded engine
    applies deltas to its parameters itself. Idempotent; returns whether the wrapper is in place
    (False: ``model`` has no ``load_weights``)."""
    if not callable(getattr(model, "load_weights", None)):
        return False
    if id(model) in _bases:
        return True
    base = _bases[id(model)] = _Base()
    original: Callable = model.load_weights

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]], *args: Any, **kwargs: Any) -> Any:
        return original(_expand(base, weights), *args, **kwargs)

    model.load_weights = load_weights
    logger.info("delta weight pushes armed: load_weights keeps a host copy of the weights as their base")
    return True


def base_of(model: Any) -> dict[str, torch.Tensor] | None:
    """The base :func:`install` keeps for ``model`` (None: not armed)."""
    b = _bases.get(id(model))
    return None if b is None else b.tensors


def _expand(base: _Base, weights: Iterable[tuple[str, torch.Tensor]]):
    """The plain tensors of ``weights``, each recorded into ``base``, and the full tensors a delta
    bucket makes of ``base``, in order."""
    rollback, base.refused = base.refused, False
    for name, t in weights:
        if is_delta(name) and rollback:
            # SGLang's update_weights_from_disk (0.5.15 to 0.5.23) rolls a failed load back by reading
            # the path again, which is the delta it just failed on: raising again kills its scheduler.
            # Nothing of it is loaded; the request still fails and the trainer's next push is full.
            logger.warning("a delta after a refused one: skipped (SGLang's rollback re-reading it)")
            continue
        if not is_delta(name):
            kept = base.tensors.get(name)
            if kept is not None and kept.shape == t.shape and kept.dtype == t.dtype:
                kept.copy_(t.detach())
            else:
                base.tensors[name] = t.detach().to("cpu", copy=True).contiguous()
            yield name, t
            continue
        try:
            yield from _apply_to_base(base, name, t)
        except DeltaError:
            base.refused = True
            raise


def _apply_to_base(base: _Base, name: str, t: torch.Tensor):
    """The full tensors delta bucket ``name`` (its payload ``t``) makes of ``base``, which it updates."""
    meta = parse_header(name)
    missing = [n for n in meta["names"] if n not in base.tensors]
    if missing:  # the trainer pushes in full after this failure
        raise DeltaError(f"delta against {meta['base']!r}: no base of {missing[0]} (no full push was loaded "
                         f"since delta pushes were armed)")
    dtype = parse_dtype(meta["dtype"])
    for n in meta["names"]:  # a full push from disk loads the file's dtype (the trainer's, e.g. float32),
        kept = base.tensors[n]  # which the model casts to the dtype it serves, the one deltas are taken in
        if kept.dtype != dtype and kept.is_floating_point() and dtype.is_floating_point:
            base.tensors[n] = kept.to(dtype)
    targets = [base.tensors[n] for n in meta["names"]]
    apply(meta, t, targets)
    for n, x in zip(meta["names"], targets):
        yield n, x.to(t.device)
