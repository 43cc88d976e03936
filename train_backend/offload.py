"""Trainer offload for colocated runs (``--offload-train``): while the engines generate on the
trainer's GPU, the trainer's optimizer state (and with ``--offload-train-params`` its parameters)
waits in pinned host memory.

What moves: every tensor in the torch optimizers' ``state`` (Adam's two moments, the step count
where it is a tensor) and, for a mixed-precision optimizer, the fp32 master copies of the
parameters it steps (megatron-core keeps them beside the bf16 model parameters). Master copies
move by swapping ``param.data``, so the optimizer, megatron's main-param bookkeeping and any
``param.main_grad`` keep pointing at the same ``Parameter`` objects.

The model parameters move only with ``params=True`` (``--offload-train-params``), and not by
swapping: a parameter is often a view into a larger buffer (the torch backend's flat parameters,
megatron's distributed-optimizer buffer, a tied embedding), so what moves is each distinct
*storage* under them. Its bytes go to the host and the storage is resized to nothing, which frees
the memory while every view, the optimizer's references and megatron's buffer bookkeeping keep
their objects; at onload the storage is resized back (a new allocation) and refilled. A storage
another process still maps cannot be freed, which is why a mapped weight push
(``--update-weight-load-format mapped``) and this option exclude each other.

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


def _distinct_storages(params: list[torch.nn.Parameter]) -> list[torch.UntypedStorage]:
    """The storages under ``params``, each once (views of one buffer and tied weights share one)."""
    out: dict[int, torch.UntypedStorage] = {}
    for p in params:
        storage = p.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in out:
            continue
        if not storage.resizable():
            raise ValueError(f"--offload-train-params: a parameter of shape {tuple(p.shape)} lives in memory torch "
                             "cannot free and reallocate (not a resizable storage); run without the option")
        out[storage.data_ptr()] = storage
    return list(out.values())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """All of ``storage`` as one uint8 tensor (a view, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class TrainOffload:
    """Moves the optimizer state and, with ``params``, the parameters' storages (module docstring)
    between the GPU and pinned host memory.

    ``model_params``: the model's parameters; optimizer parameters that are not among them are
    master copies, and move too. ``params``: move the model parameters' storages as well.
    ``offload()`` and ``onload()`` return the bytes moved. On a CPU backend the "host" copy is a
    second CPU tensor: nothing is saved, but the swap of every slot and the resize of every storage
    are the same (the tests check training through them on megatron-core's own optimizer)."""

    def __init__(self, optimizer: Any, model_params: list[torch.nn.Parameter], params: bool = False) -> None:
        self.optimizers = torch_optimizers(optimizer)
        self._model = {id(p) for p in model_params}
        self._host: dict[tuple, torch.Tensor] = {}  # slot -> its pinned buffer, reused
        self._moved: list[tuple[Any, torch.Tensor, torch.device]] = []  # (put, host buffer, device) while offloaded
        self._storages = _distinct_storages(model_params) if params else []
        self._storage_host: list[torch.Tensor] = []  # one pinned uint8 buffer per storage, reused
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
        if not self._storage_host:
            self._storage_host = [torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=s.device.type == "cuda")
                                  for s in self._storages]
        for storage, host in zip(self._storages, self._storage_host):
            host.copy_(_bytes_of(storage), non_blocking=True)
        _synchronize()  # the copies are done before the GPU memory is released
        for put, host, _ in self._moved:
            put(host)
        for storage in self._storages:
            storage.resize_(0)
        self.offloaded = True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return (sum(host.numel() * host.element_size() for _, host, _ in self._moved)
                + sum(host.numel() for host in self._storage_host))

    def onload(self) -> int:
        """Copy every offloaded slot back to its GPU (the pinned buffers stay for the next time)."""
        if not self.offloaded:
            return 0
        moved = 0
        for put, host, device in self._moved:
            put(host.to(device, non_blocking=True, copy=True))  # copy: on the CPU too (tests), never the buffer
            moved += host.numel() * host.element_size()
        for storage, host in zip(self._storages, self._storage_host):
            storage.resize_(host.numel())  # a new allocation; every view of the storage sees it
            _bytes_of(storage).copy_(host, non_blocking=True)
            moved += host.numel()
        _synchronize()  # the pinned buffers are rewritten at the next offload
        self._moved, self.offloaded = [], False
        return moved
