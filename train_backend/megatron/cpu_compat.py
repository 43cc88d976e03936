"""Run megatron-core on the CPU: the ONE place that maps its CUDA calls to the CPU.

megatron-core (0.16) is written for CUDA and calls it directly in a handful of places: tensor
factories with ``device='cuda'`` / ``torch.cuda.current_device()`` (rotary embedding, global
memory buffer, grad buffers, optimizer scalars), ``Tensor.cuda()``, type asserts such as
``param.type() == 'torch.cuda.FloatTensor'`` (optimizer, grad clipping) and the CUDA RNG
tracker used for tensor-parallel initialisation and dropout. :func:`cpu_mode` makes all of those
land on the CPU for the duration of a ``with`` block:

* a :class:`torch.overrides.TorchFunctionMode` rewrites any CUDA device argument to ``cpu``,
  turns ``Tensor.cuda()`` into a no-op and reports CPU tensors' ``type()`` under their CUDA
  name (so the asserts pass and megatron picks the same code paths as on GPU);
* ``torch.cuda.current_device`` answers 0 and ``torch.cuda.current_stream`` /
  ``default_stream`` / ``stream`` become harmless placeholders;
* the RNG tracker's ``add``/``fork`` keep CPU generator states instead of CUDA ones.

Nothing here is used on a GPU: :func:`maybe_cpu_mode` is a no-op when the device is CUDA.
Everything is undone when the block exits, so other code in the process (e.g. the torch
backend's tests) is unaffected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _is_cuda_device(x: Any) -> bool:
    if isinstance(x, torch.device):
        return x.type == "cuda"
    if isinstance(x, str):
        return x.startswith("cuda")
    return False


def _map(x: Any) -> Any:
    return _CPU if _is_cuda_device(x) else x


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron asserts on 'torch.cuda.FloatTensor' etc.: answer with the CUDA name.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        if "device" in kwargs:
            kwargs["device"] = _map(kwargs["device"])
            if isinstance(kwargs["device"], int):  # torch.cuda.current_device() -> 0
                kwargs["device"] = _CPU
        if func in (torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros):
            # Tensor.to(0) / Tensor.to('cuda') / Tensor.to(torch.device('cuda')): the device
            # is positional; an int there can only mean a CUDA ordinal.
            args = tuple(_CPU if (i == 1 and func is torch.Tensor.to and isinstance(a, int)
                                  and not isinstance(a, bool)) else _map(a)
                         for i, a in enumerate(args))
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for a CUDA stream: waiting and synchronising are no-ops on the CPU."""

    def wait_stream(self, other: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event: Any = None) -> None:
        return None


@contextlib.contextmanager
def _cpu_rng_fork(self: Any, name: str = "model-parallel-rng") -> Iterator[None]:
    # The tracker keeps named generator states; on the CPU they are CPU generator states.
    if name not in self.states_:
        raise RuntimeError(f"rng state {name} is not added")
    orig = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)


def _cpu_rng_add(self: Any, name: str, seed: int) -> None:
    self._is_initialized = True
    if seed in self.seeds_:
        raise RuntimeError(f"seed {seed} already exists")
    if name in self.states_:
        raise RuntimeError(f"rng state {name} already exists")
    self.seeds_.add(seed)
    orig = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


@contextlib.contextmanager
def cpu_mode() -> Iterator[None]:
    """Inside this block megatron-core's CUDA calls run on the CPU (see the module docstring)."""
    from megatron.core.tensor_parallel import random as mrandom

    patches: list[tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "current_stream", lambda device=None: _NullStream()),
        (torch.cuda, "default_stream", lambda device=None: _NullStream()),
        (torch.cuda, "stream", lambda s=None: contextlib.nullcontext()),
        (torch.cuda, "synchronize", lambda device=None: None),
        (mrandom.CudaRNGStatesTracker, "fork", _cpu_rng_fork),
        (mrandom.CudaRNGStatesTracker, "add", _cpu_rng_add),
    ]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    for obj, attr, new in patches:
        setattr(obj, attr, new)
    try:
        with _CudaToCpu():
            yield
    finally:
        for obj, attr, old in saved:
            setattr(obj, attr, old)


def maybe_cpu_mode(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """:func:`cpu_mode` when ``device`` is the CPU, else a no-op context."""
    return cpu_mode() if device.type == "cpu" else contextlib.nullcontext()
