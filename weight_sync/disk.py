"""Disk fallback: write the pushed weights as a loadable HF checkpoint.

For engines that share no collective fabric with the trainer (only a filesystem), a push writes
``<disk_dir>/weights_v<version>/`` (safetensors shards plus the model's config and tokenizer
files copied from ``hf_checkpoint``) and POSTs ``/update_weights_from_disk {model_path}``. The
directory is written under a temporary name and renamed when complete, so an engine never reads a
half-written checkpoint; old versions beyond ``keep`` are removed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

from sglang_protocol.buckets import parse_dtype

# What a checkpoint needs besides its weights (the template's weight files are not copied).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_MAX_SHARD = "5GB"


def checkpoint_dir(disk_dir: str | Path, version: int) -> Path:
    """Where version ``version`` is written."""
    return Path(disk_dir) / f"weights_v{version}"


def write_hf_checkpoint(named: list[tuple[str, torch.Tensor]], disk_dir: str | Path, version: int,
                        hf_checkpoint: str | Path | None = None, keep: int = 2,
                        max_shard_size: str | int = _MAX_SHARD, dtypes: list[str] | None = None) -> Path:
    """Write ``named`` as safetensors shards in ``checkpoint_dir(disk_dir, version)``; return it.

    Config/tokenizer files of ``hf_checkpoint`` are copied beside the weights (without them the
    directory has weights only, which ``/update_weights_from_disk`` of SGLang and the embedded
    engine accept, but ``from_pretrained`` does not). Tensors are copied to CPU and made
    contiguous; tensors sharing storage (tied weights) are written as separate copies.
    ``dtypes`` (one torch dtype name per tensor, e.g. the engines' ``bfloat16``): each tensor is
    written in it, cast in the same copy; the engines read the values they would have cast to.
    """
    final = checkpoint_dir(disk_dir, version)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # a previous attempt died half-way; a retried push starts clean
    tmp.mkdir(parents=True)
    if hf_checkpoint is not None:
        _copy_non_weight_files(Path(hf_checkpoint), tmp)
    # Clone on CPU: safetensors refuses shared storage, and the trainer may be on a GPU.
    want = [None] * len(named) if dtypes is None else [parse_dtype(d) for d in dtypes]
    if len(want) != len(named):
        raise ValueError(f"write_hf_checkpoint: {len(want)} dtypes for {len(named)} tensors")
    state = {name: t.detach().to("cpu", dtype=d, copy=True).contiguous() for (name, t), d in zip(named, want)}
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, str(tmp / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": split.tensor_to_filename}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if final.exists():
        shutil.rmtree(final)  # re-push of the same version (a retry): replace it whole
    tmp.rename(final)
    prune_checkpoints(disk_dir, keep)
    return final


def prune_checkpoints(disk_dir: str | Path, keep: int) -> list[Path]:
    """Remove all but the ``keep`` highest versions in ``disk_dir``; return what was removed."""
    found = []
    for p in Path(disk_dir).glob("weights_v*"):
        suffix = p.name.removeprefix("weights_v")
        if p.is_dir() and suffix.isdigit():
            found.append((int(suffix), p))
    found.sort()
    removed = [p for _, p in found[:-keep]] if keep > 0 else [p for _, p in found]
    for p in removed:
        shutil.rmtree(p)
    return removed


def _copy_non_weight_files(src: Path, dst: Path) -> None:
    if not src.is_dir():
        raise ValueError(f"hf_checkpoint {str(src)!r}: not a directory")
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_INDEXES:
            shutil.copy2(f, dst / f.name)
