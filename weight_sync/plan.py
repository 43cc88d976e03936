"""Bucket planning and validation of a push, done before anything is broadcast.

A push is validated as a whole first (names, shapes, dtypes against what every engine reported at
connect), then each tensor is given the dtype it travels in (``push_specs``: a floating tensor is
cast to its engines' dtype while its bucket is packed), then the push is split into buckets. A
bucket holds tensors of one dtype (sent flattened, its bytes travel as one ``uint8`` tensor,
``sglang_protocol/buckets.py``; one dtype keeps every tensor's offset aligned, which SGLang
requires) and at most ``bucket_bytes`` bytes, except a tensor larger than that, which travels
alone. Tensor order is kept, so engines see tensors in the order the trainer yields them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weight_sync.interfaces import TensorSpec, is_float_dtype


@dataclass
class Bucket:
    """One broadcast: tensors of one dtype, in push order (indices into the push's tensor list)."""

    dtype: str
    indices: list[int]
    specs: list[TensorSpec]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def payload(self) -> dict:
        """The metadata part of SGLang's ``/update_weights_from_distributed`` request."""
        return {"names": [s.name for s in self.specs], "dtypes": [s.dtype for s in self.specs],
                "shapes": [list(s.shape) for s in self.specs]}


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Split ``specs`` (push order) into buckets of one dtype and at most ``bucket_bytes`` bytes.

    A dtype change closes the current bucket (so offsets stay aligned), so interleaved
    dtypes give more buckets than grouping would; order is kept because engines (SGLang's
    ``load_weights``) may rely on it, e.g. to stack q/k/v.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes {bucket_bytes}: must be > 0")
    buckets: list[Bucket] = []
    cur: Bucket | None = None
    cur_bytes = 0
    for i, s in enumerate(specs):
        n = s.nbytes
        if cur is None or cur.dtype != s.dtype or cur_bytes + n > bucket_bytes:
            cur = Bucket(s.dtype, [], [])
            buckets.append(cur)
            cur_bytes = 0
        cur.indices.append(i)
        cur.specs.append(s)
        cur_bytes += n
    return buckets


def check_tensors(named: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """Specs of the trainer's tensors; ValueError naming the tensor for duplicates or non-tensors."""
    seen: set[str] = set()
    specs = []
    for name, t in named:
        if not isinstance(name, str) or not name:
            raise ValueError(f"weight name {name!r}: expected a non-empty str")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"weight {name!r}: expected a torch.Tensor, got {type(t).__name__}")
        if name in seen:
            raise ValueError(f"weight {name!r}: yielded twice in one push")
        if t.is_sparse or t.is_quantized:
            raise ValueError(f"weight {name!r}: sparse/quantized tensors cannot be pushed")
        seen.add(name)
        specs.append(TensorSpec.of(name, t))
    if not specs:
        raise ValueError("push: no tensors were given")
    return specs


def check_against_engine(specs: list[TensorSpec], engine: dict[str, TensorSpec | None], engine_url: str,
                         tied: dict[str, str] | None = None, complete: bool = True) -> None:
    """ValueError naming the first tensor that ``engine`` (its reported parameters) cannot take.

    ``engine`` maps each engine parameter name to its spec (None: only the name is known).
    Every pushed name must exist on the engine with the same shape and dtype, except that a
    floating-point tensor may differ in floating-point dtype (the push casts it to the engine's,
    ``push_specs``). With ``complete``
    (the engine listed all its parameters), every engine parameter must also be pushed: one left
    out would keep the old version's values, and the engine would then serve a mix of two
    versions. ``tied`` maps a name to the parameter it shares storage with (tied embeddings):
    pushing either one updates both.
    """
    tied = tied or {}
    pushed = set()
    for s in specs:
        if s.name not in engine:
            raise ValueError(f"weight {s.name!r}: engine {engine_url} has no parameter of that name")
        want = engine[s.name]
        if want is not None and tuple(want.shape) != tuple(s.shape):
            raise ValueError(f"weight {s.name!r}: trainer shape {list(s.shape)} != engine {engine_url} "
                             f"shape {list(want.shape)}")
        if want is not None and want.dtype != s.dtype and not (is_float_dtype(want.dtype) and
                                                               is_float_dtype(s.dtype)):
            raise ValueError(f"weight {s.name!r}: trainer dtype {s.dtype} != engine {engine_url} "
                             f"dtype {want.dtype} (only floating-point tensors are cast at a push)")
        pushed.add(s.name)
    if not complete:
        return
    missing = [n for n in engine if n not in pushed and tied.get(n) not in pushed
               and not any(t == n and a in pushed for a, t in tied.items())]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"weight {missing[0]!r}{more}: engine {engine_url} has it but the push does not "
                         f"include it (it would keep stale values)")


def push_specs(specs: list[TensorSpec], engines: list[dict[str, TensorSpec | None] | None],
               engine_dtype: str | None = None) -> list[TensorSpec]:
    """The spec each tensor travels with: a floating-point tensor takes its engines' dtype.

    ``engines``: each engine's reported parameters (``None``, or a name mapped to ``None``: the
    engine did not say), whose dtype for a name is then ``engine_dtype`` (what the launcher knows
    SGLang serves in), if given. A tensor whose engines all state one floating dtype is cast to it
    (once, on the trainer, per bucket); if they state several, it travels in the trainer's dtype
    and each engine casts at load, as each would for any dtype it does not hold. Non-floating
    tensors travel as they are (``check_against_engine`` has refused a mismatch there).
    """
    out = []
    for s in specs:
        if not is_float_dtype(s.dtype):
            out.append(s)
            continue
        stated = set()
        for params in engines:
            want = params.get(s.name) if params is not None else None
            dt = want.dtype if want is not None else engine_dtype
            if dt is not None and is_float_dtype(dt):
                stated.add(dt)
        target = stated.pop() if len(stated) == 1 else s.dtype
        out.append(s if target == s.dtype else TensorSpec(s.name, s.shape, target))
    return out
