"""Optimizer offload for colocated runs (``--offload-train``): while the engines generate on the
trainer's GPU, the trainer's optimizer state waits in pinned host memory.

What moves: every tensor in the torch optimizers' ``state`` (Adam's two moments, the step count
where it is a tensor) and, for a mixed-precision optimizer, the fp32 master copies of the
parameters it steps (megatron-core keeps them beside the bf16 model parameters). The model
parameters themselves stay: the engines' weights come from them at the next push, and megatron's
gradient buffers are laid out over them. Master copies move by swapping ``param.data``, so the
optimizer, megatron's main-param bookkeeping and any ``param.main_grad`` keep pointing at the same
``Parameter`` objects.

The host copies are allocated once (pinned) and reused, so a step costs two copies over PCIe and
no allocation. After an offload the caching allocator gives the freed blocks back to the driver
(``torch.cuda.empty_cache``): another process (the engine) can only use memory the driver has.
"""

from __future__ import annotations

from typing import Any

import torch


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The plain torch optimizers inside ``optimizer``: itself (torch backend), or the ``.optimizer``
    of each of megatron-core's wrappers (a ``ChainedOptimizer`` holds several)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    wrappers = getattr(optimizer, "chained_optimizers", [optimizer])
    inner = [getattr(w, "optimizer", None) for w in wrappers]
    if not inner or not all(isinstance(o, torch.optim.Optimizer) for o in inner):
        raise TypeError(f"--offload-train: no torch optimizer found inside {type(optimizer).__name__}")
    return inner


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class OptimizerOffload:
    """Moves the optimizer state (module docstring) between the GPU and pinned host memory.

    ``model_params``: the model's parameters; optimizer parameters that are not among them are
    master copies, and move too. ``offload()`` and ``onload()`` return the bytes moved. On a CPU
    backend the "host" copy is a second CPU tensor: nothing is saved, but the swap of every slot is
    the same (the tests check training through it on megatron-core's own optimizer)."""

    def __init__(self, optimizer: Any, model_params: list[torch.nn.Parameter]) -> None:
        self.optimizers = torch_optimizers(optimizer)
        self._model = {id(p) for p in model_params}
        self._host: dict[tuple, torch.Tensor] = {}  # slot -> its pinned buffer, reused
        self._moved: list[tuple[Any, torch.Tensor, torch.device]] = []  # (put, host buffer, device) while offloaded
        self.offloaded = False

    def _slots(self):
        """(key, get, set) for every GPU-resident tensor slot this offload manages."""
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in self._model:  # a master copy
                        yield (id(p), "data"), (lambda p=p: p.data), (lambda t, p=p: setattr(p, "data", t))
                    state = opt.state.get(p, {})
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor):
                            yield (id(p), k), (lambda s=state, k=k: s[k]), (lambda t, s=state, k=k: s.__setitem__(k, t))

    def offload(self) -> int:
        """Copy every slot to its pinned host buffer and drop the GPU tensor."""
        if self.offloaded:
            return 0
        for key, get, put in self._slots():
            t = get()
            if not t.is_cuda and torch.cuda.is_available():
                continue  # on the host already (Adam's step count)
            host = self._host.get(key)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = self._host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            host.copy_(t, non_blocking=True)
            self._moved.append((put, host, t.device))
        _synchronize()  # the copies are done before the GPU tensors are released
        for put, host, _ in self._moved:
            put(host)
        self.offloaded = True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return sum(host.numel() * host.element_size() for _, host, _ in self._moved)

    def onload(self) -> int:
        """Copy every offloaded slot back to its GPU (the pinned buffers stay for the next time)."""
        if not self.offloaded:
            return 0
        moved = 0
        for put, host, device in self._moved:
            put(host.to(device, non_blocking=True, copy=True))  # copy: on the CPU too (tests), never the buffer
            moved += host.numel() * host.element_size()
        _synchronize()  # the pinned buffers are rewritten at the next offload
        self._moved, self.offloaded = [], False
        return moved
