"""Command-line flags of weight_sync (slime's names where slime has one), and the choice of the
transport from where the trainer and the engines run (``resolve_transport``).

Each flag is declared by its ``WeightSyncSettings`` field (:mod:`flags`).
``--hf-checkpoint`` belongs to the rollout manager; it is read here (the disk transport copies its
config and tokenizer next to the pushed weights). The engines' API keys come from the rollout
settings (the ``--sglang-api-key`` / ``--sglang-admin-api-key`` pass-through), given by the caller,
as is the dtype SGLang engines serve in (``sglang_serving_dtype``). slime's
``--custom-update-weight-post-write-path`` is loaded by ``load_post_write_hook`` and handed to
``WeightSender(post_write=...)``.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from flags import add_flags, from_args, section
from sglang_protocol.dtype import serving_dtype
from weight_sync.interfaces import WeightSyncSettings

POST_WRITE_FLAG = "--custom-update-weight-post-write-path"
_POST_WRITE_PARAMS = ["args", "version_dir", "rollout_engines"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add weight_sync's flags to ``parser``: ``WeightSyncSettings``' fields declare them, plus
    slime's post-write hook (loaded by :func:`load_post_write_hook`, not a setting)."""
    add_flags(parser, WeightSyncSettings)
    g = section(parser, "weight sync")
    g.add_argument(POST_WRITE_FLAG, default=None,
                   help="slime's hook(args, version_dir, rollout_engines): called on trainer rank 0 after the disk "
                        "transport wrote a version, before the engines load it (e.g. to publish the files on a "
                        "filesystem without cross-host read-after-write consistency); rollout_engines are the "
                        "engines' URLs. Needs --update-weight-transport disk")


def load_post_write_hook(args: argparse.Namespace) -> Callable[[str, list[str]], None] | None:
    """The ``--custom-update-weight-post-write-path`` function bound to ``args`` (the namespace slime
    plugins get), as ``WeightSender(post_write=...)`` calls it: ``post_write(version_dir, engine_urls)``;
    None when the flag is not set. Loading errors name the flag and the path."""
    path = getattr(args, "custom_update_weight_post_write_path", None)
    if not path:
        return None
    from plugins.loader import load_function

    fn = load_function(path, POST_WRITE_FLAG, params=_POST_WRITE_PARAMS, is_async=False)
    return functools.partial(_call_post_write, fn, args)


def _call_post_write(fn: Callable, args: argparse.Namespace, version_dir: str, engine_urls: list[str]) -> None:
    fn(args, version_dir, list(engine_urls))


def settings_from_args(args: argparse.Namespace, api_key: str | None = None,
                       admin_api_key: str | None = None, engine_dtype: str | None = None) -> WeightSyncSettings:
    """Build and validate WeightSyncSettings; ValueError names the offending flag. ``api_key`` /
    ``admin_api_key``: the engines' keys, from the rollout settings (the launcher passes them);
    ``engine_dtype``: what SGLang engines serve in (``sglang_serving_dtype``; None: not known)."""
    post_write = getattr(args, "custom_update_weight_post_write_path", None)
    transport = args.update_weight_transport
    if post_write and transport != "disk":
        raise ValueError(f"{POST_WRITE_FLAG} {post_write}: slime calls it after a disk weight update's files are "
                         f"written; with --update-weight-transport {transport} nothing is written, so it would never "
                         "run: add --update-weight-transport disk")
    load_post_write_hook(args)  # a bad path fails here, at start-up, naming the flag
    # builds and validates (WeightSyncSettings.validate); its SettingErrors come out naming the flags
    return from_args(WeightSyncSettings, args, api_key=api_key, admin_api_key=admin_api_key, engine_dtype=engine_dtype)


@dataclass(frozen=True)
class Placement:
    """Where trainer rank 0 and the engines run, as the launcher knows it at start-up.

    trainer: ``cpu`` or ``cuda``. engines: ``cpu``, ``cuda``, or None (not known: servers given by
    ``--engine-urls``). colocated: ``--colocate`` (the engines on the trainer's GPUs; on the CPU, on
    its host). shared_gpu: without ``--colocate``, why an engine is known to share trainer rank 0's
    GPU (e.g. one GPU in the machine), or None.
    """

    trainer: str
    engines: str | None
    colocated: bool = False
    shared_gpu: str | None = None


def resolve_transport(transport: str, backend: str, where: Placement) -> tuple[str, str]:
    """``(transport, backend)`` with ``auto`` resolved for ``where``; explicit values are kept.

    auto: ``tensor`` when colocated (the engines map the trainer's buckets: no copy through a
    collective), else ``distributed`` over ``nccl`` when the trainer and the engines have GPUs of
    their own, else over ``gloo`` (a CPU on either side, or one GPU shared). ``disk`` is never
    chosen, only kept. ValueError naming the flags for what cannot work: ``tensor`` without
    ``--colocate`` (its handles open only in processes on the trainer's GPU and host, which only
    colocation guarantees), ``nccl`` with a CPU on either side, or with trainer rank 0 and an engine
    on one GPU (NCCL refuses two ranks of one group on one device: "Duplicate GPU detected", found
    only at the first push, after the engines were paused).
    """
    if transport == "tensor" and not where.colocated:
        raise ValueError("--update-weight-transport tensor hands the engines CUDA IPC handles (shared-memory files "
                         "on the CPU), which open only in processes on the trainer's GPU and host: it needs "
                         "--colocate, which places the engines there (or use --update-weight-transport auto)")
    if transport == "auto":
        transport = "tensor" if where.colocated else "distributed"
    if transport != "distributed":
        return transport, backend
    if where.trainer != "cuda":
        blocker = "the trainer runs on the CPU (--train-device cpu)"
    elif where.engines == "cpu":
        blocker = "the engines run on the CPU (--rollout-num-gpus 0 and no --device cuda in --engine-extra-args)"
    elif where.colocated:
        blocker = ("trainer rank 0 and an engine share a GPU (--colocate), and NCCL cannot join two ranks of one "
                   "group on one GPU ('Duplicate GPU detected')")
    elif where.shared_gpu:
        blocker = (f"trainer rank 0 and an engine share a GPU ({where.shared_gpu}), and NCCL cannot join two ranks "
                   "of one group on one GPU ('Duplicate GPU detected'): add --colocate (weights then go as CUDA "
                   "IPC handles, --update-weight-transport tensor)")
    else:
        blocker = None
    if backend == "nccl" and blocker:
        raise ValueError(f"--update-weight-backend nccl: {blocker}; use --update-weight-backend gloo or auto")
    if backend == "auto":
        backend = "gloo" if blocker else "nccl"
    return transport, backend


def sglang_serving_dtype(server_args: list[str], model_path: str | None) -> str | None:
    """The dtype an SGLang server started with ``server_args`` (the ``--sglang-*`` pass-through,
    as SGLang tokens) serves ``model_path`` in, by SGLang's own rule (``_get_and_verify_dtype`` in
    srt/configs/model_config.py): ``--dtype`` if given, else (``auto``) the config's ``dtype`` /
    ``torch_dtype`` (none: float32), where float32 is served as float16 (gemma models: bfloat16).
    None when it cannot be known (no readable config.json, a dtype SGLang does not name)."""
    dtype = "auto"
    for i, tok in enumerate(server_args):
        if tok == "--dtype" and i + 1 < len(server_args):
            dtype = server_args[i + 1]
        elif tok.startswith("--dtype="):
            dtype = tok.split("=", 1)[1]
    config = None
    if dtype.lower() == "auto":
        try:
            config = json.loads((Path(model_path or "") / "config.json").read_text())
        except (OSError, ValueError):
            return None
    return serving_dtype(dtype, config)
