"""Load HF safetensors into a (TP/PP-sharded) megatron GPTModel and gather it back as HF tensors."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open

from train_backend.megatron import convert
from train_backend.megatron.model import ModelDims


def _global_name(model: torch.nn.Module, local_name: str) -> str:
    """Parameter name with the *global* layer number (PP stages number their layers locally)."""
    layer, suffix = convert.split_layer_name(local_name)
    if layer is None:
        return local_name
    return f"decoder.layers.{model.decoder.layers[layer].layer_number - 1}.{suffix}"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel under megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def mcore_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(global megatron name, parameter)`` of this rank's stage, in module order."""
    m = unwrap(model)
    return [(_global_name(m, n), p) for n, p in m.named_parameters()]


class HFCheckpointReader:
    """Lazy reader over a HF checkpoint directory (``model.safetensors`` or a sharded index)."""

    def __init__(self, path: str) -> None:
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self._files = {k: os.path.join(path, v) for k, v in weight_map.items()}
        elif os.path.exists(single):
            with safe_open(single, "pt") as f:
                self._files = {k: single for k in f.keys()}
        else:
            raise ValueError(f"--hf-checkpoint {path!r}: no model.safetensors(.index.json) found")
        self._handles: dict[str, object] = {}

    def names(self) -> list[str]:
        return sorted(self._files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise ValueError(f"HF checkpoint has no tensor {name!r}")
        file = self._files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, "pt")
        return self._handles[file].get_tensor(name)  # type: ignore[attr-defined]


def _hf_shards(model: torch.nn.Module, reader: HFCheckpointReader,
               dims: ModelDims) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Each parameter of this rank's stage with its TP shard of the checkpoint, in the checkpoint's
    dtype. Raises ``RuntimeError`` if a shape does not match (wrong config or parallel layout)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for name, param in mcore_params(model):
        full = convert.hf_to_mcore(name, [reader.get(n) for n in convert.hf_names(name, dims)], dims)
        shard = convert.tp_shard(name, full, tp_rank, tp_size)
        if shard.shape != param.shape:
            raise RuntimeError(f"{name}: checkpoint shard {tuple(shard.shape)} != parameter "
                               f"{tuple(param.shape)} (tp {tp_rank}/{tp_size})")
        yield param, shard


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, reader: HFCheckpointReader, dims: ModelDims) -> None:
    """Copy the HF tensors into every parameter of this rank's stage and TP shard (cast to the
    parameters' dtype). Raises ``RuntimeError`` if a shape does not match."""
    for param, shard in _hf_shards(model, reader, dims):
        param.copy_(shard)


def _master_slices(optimizer: Any) -> dict[int, tuple[torch.Tensor, int, int]]:
    """``id(model parameter) -> (its fp32 master, start, end)``: the master holds elements
    ``start:end`` of the flattened parameter. megatron-core's mixed-precision optimizers: the plain
    one keeps a whole master per bf16 parameter (``param.main_param``), the distributed one a
    shard of it on each data-parallel rank (its range map says which elements)."""
    out: dict[int, tuple[torch.Tensor, int, int]] = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
            for params, shards in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
                for p, shard in zip(params, shards):
                    r = opt._get_model_param_range_map(p)["param"]  # megatron's own map (no public one)
                    out[id(p)] = (shard, r.start, r.end)
        elif hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
            for params, masters in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for p, main in zip(params, masters):
                    out[id(p)] = (main, 0, main.numel())
    return out


@torch.no_grad()
def load_hf_master_weights(optimizer: Any, model: torch.nn.Module, reader: HFCheckpointReader,
                           dims: ModelDims) -> int:
    """Set the fp32 master weights of bf16 parameters to the checkpoint's own values; returns how
    many parameters have one.

    megatron-core makes each master from its bf16 parameter, so a checkpoint finer than bf16 (an
    fp32 one) would start training from its bf16 rounding: every master sits on the bf16 grid, and
    a small update changes no bf16 weight (neither the forward's nor the engines') until it reaches
    half a bf16 spacing. Started from the checkpoint's values, the masters lie between grid points
    as in fp32 training, and the bf16 copies follow their updates from the first step."""
    masters = _master_slices(optimizer)
    for param, shard in _hf_shards(model, reader, dims):
        if id(param) in masters:
            main, start, end = masters[id(param)]
            main.copy_(shard.reshape(-1)[start:end].view_as(main))
    return len(masters)


@torch.no_grad()
def _full_tensor(name: str, param: torch.Tensor) -> torch.Tensor:
    """All-gather ``param`` over the TP group and reassemble the full tensor (all TP ranks call)."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if convert.partition_dim(name) is None or tp_size == 1:
        return param.detach()
    shards = [torch.empty_like(param) for _ in range(tp_size)]
    dist.all_gather(shards, param.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return convert.tp_unshard(name, shards)


@torch.no_grad()
def iter_hf_weights(model: torch.nn.Module, dims: ModelDims) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the whole model as HF ``(name, tensor)`` pairs on global rank 0; nothing elsewhere.

    Every rank must run the generator to the end: TP shards are all-gathered inside each stage
    and PP stages send their tensors to rank 0 point-to-point. Only data-parallel replica 0
    takes part (other replicas hold the same weights). With tied embeddings the last stage's
    output-layer copy is skipped. Tensors are on the model's device and dtype.
    """
    if parallel_state.get_data_parallel_rank() != 0:
        return
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    params = [(n, p) for n, p in mcore_params(model)
              if not (dims.tied_embeddings and n == "output_layer.weight")]
    # Rank 0 needs every stage's names, full shapes and dtypes to receive them.
    local_meta = [(n, tuple(_full_shape(n, p)), str(p.dtype).removeprefix("torch.")) for n, p in params]
    if pp_size > 1:
        all_meta: list[list] = [None] * pp_size  # type: ignore[list-item]
        dist.all_gather_object(all_meta, local_meta, group=pp_group)
    else:
        all_meta = [local_meta]
    stage_ranks = dist.get_process_group_ranks(pp_group) if pp_size > 1 else [dist.get_rank()]
    for stage in range(pp_size):
        if stage == pp_rank:
            for name, param in params:
                full = _full_tensor(name, param)
                if tp_rank != 0:
                    continue
                if stage == 0:
                    yield from convert.mcore_to_hf(name, full, dims)
                else:
                    dist.send(full.contiguous(), dst=stage_ranks[0])
        elif pp_rank == 0 and tp_rank == 0:
            device = params[0][1].device if params else torch.device("cpu")
            for name, shape, dtype in all_meta[stage]:
                buf = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                dist.recv(buf, src=stage_ranks[stage])
                yield from convert.mcore_to_hf(name, buf, dims)


def _full_shape(name: str, param: torch.Tensor) -> list[int]:
    shape = list(param.shape)
    dim = convert.partition_dim(name)
    if dim is not None:
        shape[dim] *= parallel_state.get_tensor_model_parallel_world_size()
    return shape
