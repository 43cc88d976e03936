"""A model's ``load_weights`` recorded once and replayed as batched copies (held pushes).

SGLang's ``load_weights`` walks the tensors it is given in Python: for each it finds the
parameter, picks its TP shard and its slot in a stacked projection (q/k/v into ``qkv_proj``,
gate/up into ``gate_up_proj``) and copies it there. A held push (``held_weights``) sends the same
trainer storages at every push, so every push makes the same copies, from the same received bytes
into the same parameter bytes; only the values differ. Walking the model again costs more than
the copies themselves (a 7B model: hundreds of tensors, each a Python walk and a small kernel).

:func:`record` runs ``load_weights`` once under a ``TorchDispatchMode``, which sees every aten op,
and keeps each op that writes into a parameter's storage: a ``copy_`` from a view of the
received storages (the cast included), or another in-place op (e.g. the ``fill_`` of a padded
vocabulary's rows) whose inputs are such views, parameters or constants. :class:`Plan.replay`
makes the same writes again: runs of copies whose targets do not overlap go through one
``torch._foreach_copy_`` per dtype pair, in the recorded order otherwise.

A load that writes a parameter from anything else (a temporary it computed, a tensor made on the
host), or that replaces a parameter's storage, cannot be replayed: :func:`record` returns no plan
and says why, and the caller keeps calling ``load_weights``. Writes that bypass torch's dispatcher
(a raw kernel handed a data pointer) are invisible here; the loaders of bf16/fp32 checkpoints in
SGLang do not make them, and ``--check-weight-update-equal`` reads the engine's weights back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten


@dataclass(frozen=True)
class _View:
    """Where a tensor an op used lies: storage ``index`` of ``kind`` ("recv": the received
    tensors, "param": the model's parameters), its dtype and its strided place there."""
    kind: str
    index: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements of dtype

    def bytes_span(self) -> tuple[int, int]:
        """The first byte and one past the last that the view can touch (contiguous or not)."""
        itemsize = self.dtype.itemsize
        if 0 in self.size:
            return self.offset * itemsize, self.offset * itemsize
        last = self.offset + sum((n - 1) * s for n, s in zip(self.size, self.stride))
        return self.offset * itemsize, (last + 1) * itemsize


@dataclass
class Plan:
    """The parameter writes of one ``load_weights`` call, bound to the storages they touch."""
    steps: list[Callable[[], None]] = field(default_factory=list)
    num_copies: int = 0
    replays: int = 0

    def replay(self) -> None:
        with torch.no_grad():
            for step in self.steps:
                step()
        self.replays += 1


def signature(received: list[tuple[str, Any]], state: list[torch.Tensor]) -> tuple:
    """What must be unchanged for a plan to apply: each received pair's name, address, size and
    dtype, and each parameter's and buffer's address (a reload can move them)."""
    return (tuple((n, t.data_ptr(), t.numel(), t.dtype) for n, t in received),
            tuple(p.data_ptr() for p in state))


class _Recorder(TorchDispatchMode):
    def __init__(self, recv: dict[int, int], params: dict[int, int]):
        super().__init__()
        self.recv, self.params = recv, params
        self.ops: list[tuple[Any, list, Any]] = []  # (func, flat args with _View in place of tensors, spec)
        self.refusal: str | None = None
        self.made: set[int] = set()  # storages the load allocated (its temporaries)

    def _where(self, t: torch.Tensor) -> _View | None:
        key = t.untyped_storage().data_ptr()
        for kind, table in (("recv", self.recv), ("param", self.params)):
            if key in table:
                return _View(kind, table[key], t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.refusal is None:
            self._note(func, args, kwargs)
        out = func(*args, **kwargs)
        self.made.update(x.untyped_storage().data_ptr() for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor))
        return out

    def _note(self, func, args, kwargs) -> None:
        targets = []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                value = kwargs[a.name] if a.name in kwargs else args[i] if i < len(args) else None
                targets.extend(x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor))
        keys = [t.untyped_storage().data_ptr() for t in targets]
        if not any(k in self.params for k in keys):
            foreign = [k for k in keys if k not in self.recv and k not in self.made]
            if foreign:
                self.refusal = f"{func}: writes a tensor that is neither a parameter, a buffer nor a temporary"
            return  # reads, views and writes into temporaries of the load
        flat, spec = tree_flatten((args, kwargs))
        bound = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                where = self._where(x)
                if where is None:
                    self.refusal = (f"{func}: writes a parameter from a tensor that is neither received nor "
                                    f"a parameter (shape {tuple(x.shape)}, {x.dtype})")
                    return
                bound.append(where)
            else:
                bound.append(x)
        self.ops.append((func, bound, spec))


def record(model: torch.nn.Module, received: list[tuple[str, torch.Tensor]], load: Callable[[], None]) -> tuple[Plan | None, str]:
    """Run ``load()`` (the model's own loading of ``received``) once, recording its writes into
    ``model``'s parameters and buffers. Returns the plan, or None and why it cannot be replayed."""
    if hasattr(model, "post_load_weights"):  # SGLang's hook for tensors derived from the loaded ones
        load()
        return None, f"{type(model).__name__} derives tensors after loading (post_load_weights)"
    state = model_tensors(model)
    recv_storages = [t.untyped_storage() for _, t in received]
    state_storages = [t.untyped_storage() for t in state]
    before = signature(received, state)
    attrs = _tensor_attributes(model)
    recorder = _Recorder({s.data_ptr(): i for i, s in enumerate(recv_storages)},
                         {s.data_ptr(): i for i, s in enumerate(state_storages)})
    with recorder:
        load()
    if recorder.refusal is not None:
        return None, recorder.refusal
    if signature(received, model_tensors(model)) != before or _tensor_attributes(model) != attrs:
        return None, "the load replaced a parameter, a buffer or a tensor attribute of the model"
    return _build(recorder.ops, {"recv": recv_storages, "param": state_storages}), ""


def model_tensors(model: Any) -> list[torch.Tensor]:
    """The model's parameters and buffers: the state a load writes."""
    return list(model.parameters()) + list(model.buffers())


def _tensor_attributes(model: Any) -> dict[tuple[int, str], int]:
    """Each module's plain tensor attributes (not parameters or buffers), by identity: a load that
    assigns one (a tensor derived from the weights) is not a sequence of writes."""
    return {(id(m), k): id(v) for m in model.modules() for k, v in vars(m).items() if isinstance(v, torch.Tensor)}


def _bind(v: _View, storages: dict[str, list]) -> torch.Tensor:
    st = storages[v.kind][v.index]
    return torch.empty(0, dtype=v.dtype, device=st.device).set_(st, v.offset, v.size, v.stride)


def _build(ops: list, storages: dict[str, list]) -> Plan:
    plan = Plan()
    run: list[tuple[_View, _View]] = []

    def flush() -> None:
        if run:
            plan.steps.extend(_copy_steps(list(run), storages))
            plan.num_copies += len(run)
            run.clear()

    for func, bound, spec in ops:
        args, kwargs = tree_unflatten(bound, spec)
        if func is torch.ops.aten.copy_.default and isinstance(args[1], _View):
            run.append((args[0], args[1]))
            continue
        flush()
        live = [_bind(x, storages) if isinstance(x, _View) else x for x in bound]
        a, k = tree_unflatten(live, spec)
        plan.steps.append(lambda f=func, a=a, k=k: f(*a, **k))
    flush()
    return plan


def _copy_steps(run: list[tuple[_View, _View]], storages: dict[str, list]) -> list[Callable[[], None]]:
    """One ``_foreach_copy_`` per (target dtype, source dtype, device) when no two targets overlap
    and no target is a source of the run; else the copies one by one, in order."""
    spans = sorted((d.kind, d.index, *d.bytes_span()) for d, _ in run)
    overlap = any(a[:2] == b[:2] and b[2] < a[3] for a, b in zip(spans, spans[1:]))
    targets = {(d.kind, d.index) for d, _ in run}
    overlap = overlap or any((s.kind, s.index) in targets for _, s in run)
    pairs = [(_bind(d, storages), _bind(s, storages)) for d, s in run]
    if overlap:
        return [lambda d=d, s=s: d.copy_(s) for d, s in pairs]
    groups: dict[tuple, tuple[list, list]] = {}
    for d, s in pairs:
        g = groups.setdefault((d.dtype, s.dtype, d.device, s.device), ([], []))
        g[0].append(d)
        g[1].append(s)
    return [lambda dst=dst, src=src: torch._foreach_copy_(dst, src) for dst, src in groups.values()]
