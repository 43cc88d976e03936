"""The launcher's command line: every part's flags in one parser, ``--config`` defaults, and the
cross-part checks, done once at start-up with messages that name the flags.

Each part owns its flags (``<part>/arguments.py``: ``add_arguments(parser)`` and
``settings_from_args(args)``); this module owns only the launcher's own flags and composes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from buffer.settings import BufferSettings
from flags import SettingError, add_flags, check_bound, flag, flag_of, from_args
from flags.parser import ArgumentParser
from rollout_manager.settings import (EngineFleetSettings, PluginSettings, RolloutLoopSettings, RolloutSettings,
                                      SamplingSettings)
from scripts.config import load_config_defaults, passthrough_tokens
from train_backend.actor_group import TrainerGroupSettings
from train_backend.settings import TrainSettings

log = logging.getLogger(__name__)


@dataclass
class LauncherSettings(RolloutLoopSettings):
    """The driver's own settings (the loop, checkpoints, logging, debug modes); each field declares
    its flag (:mod:`flags`). ``--num-rollout`` and ``--ray-address`` come from
    :class:`~rollout_manager.settings.RolloutLoopSettings` (``python -m rollout_manager`` has them too)."""

    output_dir: str = flag("runs/latest", "metrics.jsonl, TensorBoard events, plots")
    save: str | None = flag(None, "checkpoint directory")
    load: str | None = flag(None, "resume from this checkpoint directory")
    save_interval: int | None = flag(None, "steps between checkpoints")
    eval_interval: int | None = flag(None, "steps between evaluations")
    skip_eval_before_train: bool = flag(False, "no evaluation before the first training step")
    debug_rollout_only: bool = flag(False, "generate and score only; no trainer")
    debug_train_only: bool = flag(False, "train on --load-debug-rollout-data; no engines")
    save_debug_rollout_data: str | None = flag(None, "write each rollout batch to this path pattern, e.g. "
                                               "dumps/rollout_{rollout_id}.parquet")
    load_debug_rollout_data: str | None = flag(None, "read rollout batches from this path pattern instead of "
                                               "generating")
    use_tensorboard: bool = flag(False, "also write TensorBoard events to <--output-dir>/tensorboard")
    use_wandb: bool = flag(False, "also log the metrics to Weights & Biases (needs the wandb package)")
    wandb_project: str | None = flag(None, "wandb project (default: reservoir)")
    wandb_group: str | None = flag(None, "wandb run group (slime's flag)")
    wandb_key: str | None = flag(None, "wandb API key to log in with (slime's flag; default: wandb's stored login or "
                                 "WANDB_API_KEY)")
    buffer_name: str = flag("reservoir-buffer", "name of the buffer actor")
    colocate: bool = flag(False, "trainer ranks and engines share the GPUs (trainer rank i and engine i on GPU i of "
                          "this node; --rollout-num-gpus defaults to the trainer's GPUs): weights go as CUDA IPC "
                          "handles (--update-weight-transport auto -> tensor) and the engines release their KV "
                          "cache while the trainer trains (--no-offload-rollout: they keep it). On the CPU: the same "
                          "host, weights through shared memory")
    offload_rollout: bool | None = flag(None, "with --colocate, the engines release their KV cache while the trainer "
                                        "trains and take it back after the push (slime's flag; default: on with "
                                        "--colocate). --no-offload-rollout keeps it in place: a step saves the "
                                        "engines' pause, release, resume and continue calls, for a trainer that fits "
                                        "beside the engines' static memory (--sglang-mem-fraction-static)")
    no_plots: bool = flag(False, "skip the PNG plots at the end")
    build_toy_model: bool = flag(False, "build the toy model (scripts/make_toy_model.py) at --hf-checkpoint if it is "
                                 "missing; from a --config file only at examples/toy/model (a mistyped "
                                 "--hf-checkpoint is an error, not a new model)",
                                 action=argparse.BooleanOptionalAction)
    toy_warmup_steps: int = flag(60, "supervised warm-up steps when --build-toy-model builds it")

    def __post_init__(self) -> None:
        super().__post_init__()
        wandb = [f for f in ("wandb_project", "wandb_group", "wandb_key") if getattr(self, f)]
        if wandb and not self.use_wandb:
            raise SettingError((*wandb, "use_wandb"), ", ".join("{" + f + "}" for f in wandb) + " need(s) {use_wandb}")
        if self.debug_rollout_only and self.debug_train_only:
            raise SettingError(("debug_rollout_only", "debug_train_only"),
                               "{debug_rollout_only} and {debug_train_only} exclude each other")
        if self.debug_train_only and not self.load_debug_rollout_data:
            raise SettingError(("debug_train_only", "load_debug_rollout_data"),
                               "{debug_train_only} needs {load_debug_rollout_data}")
        if self.load_debug_rollout_data and not self.debug_train_only:
            raise SettingError(("load_debug_rollout_data", "debug_train_only"),
                               "{load_debug_rollout_data} is only read with {debug_train_only}")
        check_bound(self, ">=", 1, "save_interval", "eval_interval")
        if self.offload_rollout and not self.colocate:
            raise SettingError(("offload_rollout", "colocate"), "{offload_rollout} hands the engines' memory to the "
                               "trainer ranks on their GPUs: it needs {colocate}")
        if self.save_interval and not self.save:
            raise SettingError(("save_interval", "save"), "{save_interval} needs {save} (the checkpoint directory)")


# Flags the cross-part checks below name, as their fields declare them
_COLOCATE = flag_of(LauncherSettings, "colocate")
_ENGINE_URLS = flag_of(EngineFleetSettings, "engine_urls")
_ROLLOUT_GPUS = flag_of(EngineFleetSettings, "rollout_num_gpus")
_EXTRA_ARGS = flag_of(EngineFleetSettings, "engine_extra_args")
_TRAIN_DEVICE = flag_of(TrainSettings, "device")
_TRAINER_GPUS = (f"{flag_of(TrainerGroupSettings, 'actor_num_nodes')} x "
                 f"{flag_of(TrainerGroupSettings, 'actor_num_gpus_per_node')}")


def _part_modules():
    import buffer.arguments
    import rollout_manager.arguments
    import train_backend.arguments
    import train_backend.megatron.arguments
    import weight_sync.arguments

    return [rollout_manager.arguments, buffer.arguments, train_backend.arguments,
            train_backend.megatron.arguments, weight_sync.arguments]


def build_parser() -> argparse.ArgumentParser:
    # flags.parser: a usage error is two lines (argparse's would print every option first)
    p = ArgumentParser(prog="scripts/train.py", description="Reservoir: RL post-training, end to end.",
                       allow_abbrev=False,  # --num-roll must not pass for --num-rollout
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="YAML file of flag defaults (the command line overrides it)")
    add_flags(p, LauncherSettings, "launcher")
    for module in _part_modules():
        module.add_arguments(p)
    return p


@dataclass(frozen=True)
class RunSettings:
    """Every part's settings, built (and so validated) once at start-up from the flags. The driver
    and its wiring read these; the Namespace itself goes only to plugins, as their ``args``.
    ``sync`` lacks what the rollout side adds once it runs (the engines' keys and serving dtype)."""

    launcher: LauncherSettings
    buffer: Any  # buffer.settings.BufferSettings
    rollout: Any  # rollout_manager.settings.RolloutSettings
    train: Any  # train_backend.settings.TrainSettings
    megatron: Any  # train_backend.megatron.arguments.MegatronSettings
    group: Any  # train_backend.actor_group.TrainerGroupSettings (--colocate applied)
    sync: Any  # weight_sync.interfaces.WeightSyncSettings (the transport chosen)


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, RunSettings]:
    """Parse ``argv`` with ``--config`` defaults applied first and build every part's settings
    (validated once); exit 2 naming the flag on errors. Returns the Namespace (plugins' ``args``)
    and the settings."""
    from rollout_manager.arguments import split_sglang_args

    parser = build_parser()
    # --sglang-* flags pass through to SGLang servers; their set depends on the installed SGLang
    argv, sglang_args = split_sglang_args(sys.argv[1:] if argv is None else list(argv))
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        try:
            defaults = load_config_defaults(parser, pre.config)
            parser.set_defaults(**defaults)
            # the file's --sglang-* keys go first: the command line's own come after and win
            sglang_args = split_sglang_args(passthrough_tokens(parser, pre.config))[1] + sglang_args
        except ValueError as e:
            parser.error(str(e))
    args = parser.parse_args(argv)
    args.sglang_args = sglang_args
    if args.build_toy_model and not any(a == flag_of(LauncherSettings, "build_toy_model") for a in argv):
        from scripts import make_toy_model

        # a config file's build-toy-model builds only the toy model's own directory
        args.build_toy_model = Path(args.hf_checkpoint or "").resolve() == make_toy_model.DEFAULT_DIR
    try:
        settings = build_settings(args)
    except ValueError as e:
        parser.error(str(e))
    return args, settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """:func:`parse`'s Namespace alone (what tests of the flags read)."""
    return parse(argv)[0]


def launcher_settings_from_args(args: argparse.Namespace) -> LauncherSettings:
    """Build (and so check) :class:`LauncherSettings`; ``ValueError`` names the flags."""
    return from_args(LauncherSettings, args)


def build_settings(args: argparse.Namespace) -> RunSettings:
    """Each part's settings from its ``settings_from_args`` (its own checks), then the cross-part
    checks; ``ValueError`` names the flags."""
    from buffer.arguments import settings_from_args as buffer_settings
    from rollout_manager.arguments import settings_from_args as rollout_settings
    from rollout_manager.arguments import with_engine_admin_key
    from train_backend.arguments import group_settings_from_args
    from train_backend.arguments import settings_from_args as train_settings
    from train_backend.megatron.arguments import settings_from_args as megatron_settings
    from weight_sync.arguments import settings_from_args as sync_settings

    _place_colocated(args)  # its derived defaults (--rollout-num-gpus, placement) before the parts' checks
    rollout = with_engine_admin_key(rollout_settings(args, args.sglang_args))
    buffer = buffer_settings(args)
    train, megatron = train_settings(args), megatron_settings(args)
    group = group_settings_from_args(args, train, megatron)  # trainer ranks vs. the backend's parallel layout
    launcher = launcher_settings_from_args(args)
    _check_launcher(args)
    building = args.hf_checkpoint if args.build_toy_model and not Path(args.hf_checkpoint, "config.json").is_file() \
        else None
    check_inputs(launcher, rollout, building)
    _check_gpu_count(args)
    _choose_weight_transport(args)
    sync = sync_settings(args)
    if sync.transport == "tensor" and sync.load_format == "mapped":  # one handle per dtype, not per parameter
        train = dataclasses.replace(train, flat_params=True)
    if train.lora is not None and train.lora.enabled:
        rollout, sync = _with_lora(train.lora, rollout, sync, launcher.output_dir)
    _check_across_parts(args)
    return RunSettings(launcher, buffer, rollout, train, megatron, group, sync)


def _with_lora(lora: Any, rollout: Any, sync: Any, output_dir: str) -> tuple[Any, Any]:
    """``--lora-rank``: the engines serve LoRA adapters (SGLang's --enable-lora), every /generate names
    the policy's adapter, and pushes write it under ``--update-weight-disk-dir`` (default: the run's
    ``lora_adapters/``), which the embedded engines are allowed to read (weight_sync/lora.py)."""
    from rollout_manager.settings import EngineFleetSettings
    from sglang_protocol.lora_adapter import POLICY_ADAPTER
    from train_backend.lora import LoraSettings
    from weight_sync.interfaces import WeightSyncSettings

    if (sync.check_equal and rollout.engines.rollout_engine != "embedded"
            and sync.resolved_transport() != "tensor"):  # SGLang reads no adapter back; it checks a tensor load
        raise ValueError(f"{flag_of(WeightSyncSettings, 'check_equal')} with {flag_of(LoraSettings, 'rank')}: "
                         f"{flag_of(EngineFleetSettings, 'rollout_engine')} {rollout.engines.rollout_engine} has no "
                         "route reading an adapter back (the embedded engine's /lora_adapter_checksum); it checks an "
                         "adapter loaded from tensors (--colocate)")
    modules = lora.modules()
    engines = dataclasses.replace(rollout.engines, lora_rank=lora.rank,
                                  lora_target_modules=None if modules == "all-linear" else modules)
    rollout = dataclasses.replace(rollout, engines=engines,
                                  sampling=dataclasses.replace(rollout.sampling, lora_path=POLICY_ADAPTER))
    if not sync.disk_dir:
        sync = dataclasses.replace(sync, disk_dir=str((Path(output_dir) / "lora_adapters").resolve()))
    return rollout, sync


def _check_launcher(args: argparse.Namespace) -> None:
    """The launcher's flags against the model and the other parts' flags (its own flags alone:
    :class:`LauncherSettings`)."""
    ckpt = args.hf_checkpoint
    hf = flag_of(RolloutSettings, "hf_checkpoint")
    if not ckpt:
        raise ValueError(f"{hf} is required (the model to train and serve)")
    if not args.build_toy_model and not Path(ckpt, "config.json").is_file():
        raise ValueError(f"{hf} {ckpt}: no HF checkpoint there (config.json missing); "
                         f"{flag_of(LauncherSettings, 'build_toy_model')} builds the toy model at that path")
    _check_wandb(args)
    if args.eval_interval and not args.eval_prompt_data:
        raise ValueError(f"{flag_of(LauncherSettings, 'eval_interval')} needs "
                         f"{flag_of(SamplingSettings, 'eval_prompt_data')}")


def check_inputs(settings: "RunSettings | LauncherSettings", rollout: Any = None, building: str | None = None) -> None:
    """Every file the run reads as it starts, checked before anything starts or is written (no Ray,
    no engine, no output directory: a typo costs seconds and leaves nothing behind); ``ValueError``
    names the flag. The rollout side's (``rollout_manager.arguments.check_input_files``) unless
    --debug-train-only, ``--load``'s checkpoint, --load-debug-rollout-data's batches. ``building``:
    the toy model's directory, about to be built; what lies inside it is checked once it is.
    Called with a ``RunSettings``, or a ``LauncherSettings`` and the ``RolloutSettings``."""
    from rollout_manager.arguments import check_input_files

    launcher, rollout = (settings.launcher, settings.rollout) if isinstance(settings, RunSettings) \
        else (settings, rollout)
    if not launcher.debug_train_only:
        check_input_files(rollout, building)
    if launcher.load:
        checkpoint_dir(launcher.load)
    elif launcher.debug_train_only:
        pattern = launcher.load_debug_rollout_data
        missing = [step for step in range(launcher.num_rollout)
                   if not Path(pattern.format(rollout_id=step)).is_file()]
        if missing:
            raise ValueError(f"{flag_of(LauncherSettings, 'load_debug_rollout_data')} {pattern}: no file for step "
                             f"{missing[0]} ({pattern.format(rollout_id=missing[0])}), {len(missing)} of the "
                             f"{launcher.num_rollout} steps missing")


def checkpoint_dir(load_dir: str) -> Path:
    """The checkpoint ``--load load_dir`` resumes from (named by its ``latest.json``); ``ValueError`` if there is none."""
    load = flag_of(LauncherSettings, "load")
    latest = Path(load_dir) / "latest.json"
    if not latest.is_file():
        raise ValueError(f"{load} {load_dir}: no latest.json (not a checkpoint directory written by --save)")
    try:
        path = Path(json.loads(latest.read_text())["path"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{load} {load_dir}: latest.json does not name a checkpoint") from None
    if not path.is_dir():
        raise ValueError(f"{load} {load_dir}: latest.json names {path}, which does not exist")
    return path


def _check_across_parts(args: argparse.Namespace) -> None:
    from weight_sync.interfaces import WeightSyncSettings

    engine = flag_of(EngineFleetSettings, "rollout_engine")
    if not args.debug_rollout_only and (args.rollout_top_p < 1 or args.rollout_top_k > 0):
        log.warning("%s %s / %s %s: rollouts are sampled from the truncated distribution, but training uses "
                    "log-probs of the untruncated distribution (the engines' rollout log-probs and the trainer's "
                    "alike, SGLang's default), so the policy ratios are off by the truncation",
                    flag_of(SamplingSettings, "rollout_top_p"), args.rollout_top_p,
                    flag_of(SamplingSettings, "rollout_top_k"), args.rollout_top_k)
    teacher = [flag_of(PluginSettings, n) for n in ("opd_teacher_url", "opd_teacher_load") if getattr(args, n)]
    use_opd = flag_of(TrainSettings, "use_opd")
    if teacher and not args.use_opd:
        raise ValueError(f"{teacher[0]} needs {use_opd} (the teacher only serves on-policy distillation)")
    if args.use_opd and not teacher and not args.debug_train_only:
        raise ValueError(f"{use_opd} {flag_of(TrainSettings, 'opd_type')} sglang needs the teacher engine: "
                         f"{flag_of(PluginSettings, 'opd_teacher_url')} URL or "
                         f"{flag_of(PluginSettings, 'opd_teacher_load')} HF_CHECKPOINT")
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if args.global_batch_size is not None and samples % args.global_batch_size:
        raise ValueError(f"{flag_of(TrainSettings, 'global_batch_size')} {args.global_batch_size} must divide "
                         f"{flag_of(SamplingSettings, 'rollout_batch_size')} x "
                         f"{flag_of(SamplingSettings, 'n_samples_per_prompt')} = {samples}")


def _check_wandb(args: argparse.Namespace) -> None:
    """--use-wandb needs the package (found now, not after Ray and the engines started)."""
    import importlib.util

    if args.use_wandb and importlib.util.find_spec("wandb") is None:
        use = flag_of(LauncherSettings, "use_wandb")
        given = "".join(f", {flag_of(LauncherSettings, f)}" for f in ("wandb_project", "wandb_group", "wandb_key")
                        if getattr(args, f))
        raise ValueError(f"{use}{given}: the wandb package is not installed (pip install wandb), or drop {use}")


# --- where the trainer and the engines run (--colocate, the weight transport) ---------------------------
def _place_colocated(args: argparse.Namespace) -> None:
    """``--colocate``: refuse what cannot share GPUs, and derive the rest (slime's rule: the engines
    get as many GPUs as the trainer; they start as local subprocesses, engine i on GPU i, and
    trainer rank i goes to GPU i too: ``train_backend/actor_group.py``)."""
    if not args.colocate:
        return
    if args.engine_urls:
        raise ValueError(f"{_COLOCATE} places the engines it starts on the trainer's GPUs; servers given by "
                         f"{_ENGINE_URLS} run elsewhere: drop one of the two")
    if args.max_weight_staleness:
        raise ValueError(f"{_COLOCATE} needs sync mode (the GPUs alternate between generating and training): drop "
                         f"{flag_of(BufferSettings, 'max_weight_staleness')} {args.max_weight_staleness}")
    if args.rollout_engine_placement == "ray":
        raise ValueError(f"{_COLOCATE} places the engines itself (engine i and trainer rank i on GPU i of this "
                         "node); a Ray placement group would reserve whole GPUs for them: drop "
                         f"{flag_of(EngineFleetSettings, 'rollout_engine_placement')} ray")
    args.rollout_engine_placement = "local"
    if args.offload_rollout is None:
        args.offload_rollout = True  # slime's default with --colocate: the engines release their KV cache
    if args.train_device.startswith("cuda"):
        ranks = args.actor_num_nodes * args.actor_num_gpus_per_node
        if args.rollout_num_gpus == 0:
            args.rollout_num_gpus = ranks
        elif args.rollout_num_gpus != ranks:
            raise ValueError(f"{_COLOCATE}: {_ROLLOUT_GPUS} {args.rollout_num_gpus} must equal the trainer's GPUs, "
                             f"{_TRAINER_GPUS} = {ranks} (each GPU holds a trainer rank and engine ranks), or be "
                             "left out")
        saver = any(a.split("=", 1)[0] == "--enable-memory-saver" for a in args.sglang_args)
        if args.rollout_engine == "sglang" and args.offload_rollout and not saver:
            args.sglang_args = [*args.sglang_args, "--enable-memory-saver"]  # else its release frees nothing
    if _engine_device(args) != ("cuda" if args.train_device.startswith("cuda") else "cpu"):
        raise ValueError(f"{_COLOCATE}: the trainer ({_TRAIN_DEVICE} {args.train_device}) and the engines "
                         f"({_engine_device(args)}: {_ROLLOUT_GPUS} {args.rollout_num_gpus}, {_EXTRA_ARGS} "
                         f"{args.engine_extra_args!r}) must be on the same kind of device")


def _engine_device(args: argparse.Namespace) -> str | None:
    """``cuda`` or ``cpu``: where the engines started here run; None for --engine-urls (not known)."""
    if args.engine_urls:
        return None
    if args.rollout_engine == "sglang":
        return "cuda"
    return "cuda" if (_engine_device_flag(args) or ("cuda" if args.rollout_num_gpus else "cpu")).startswith("cuda") \
        else "cpu"


def _engine_device_flag(args: argparse.Namespace) -> str | None:
    """The embedded engines' ``--device`` in --engine-extra-args (the last one wins, as in argparse)."""
    device = None
    toks = shlex.split(args.engine_extra_args or "")
    for i, tok in enumerate(toks):
        if tok == "--device" and i + 1 < len(toks):
            device = toks[i + 1]
        elif tok.startswith("--device="):
            device = tok.split("=", 1)[1]
    return device


def _visible_gpus() -> int:
    """GPUs this machine shows the launcher (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _ray_places_engines(args: argparse.Namespace) -> bool:
    """Whether the engines' GPUs are reserved in Ray (placement groups), not picked by index."""
    return args.rollout_num_gpus > 0 and args.rollout_engine_placement in ("auto", "ray")


def _shared_gpu(args: argparse.Namespace) -> str | None:
    """Without --colocate: why trainer rank 0 and an engine are known to be on one GPU, or None.
    Engines placed by index (local placement, or ``--device`` in --engine-extra-args without GPUs)
    are invisible to Ray, which may give the trainer the same GPU: with one GPU it certainly does."""
    if args.colocate or not args.train_device.startswith("cuda") or _engine_device(args) != "cuda" \
            or _ray_places_engines(args):
        return None
    flag = _engine_device_flag(args)
    if args.rollout_num_gpus:
        engine_gpus = set(range(args.rollout_num_gpus))
        where = f"{_ROLLOUT_GPUS} {args.rollout_num_gpus} placed locally"
    else:
        engine_gpus = {int(flag.split(":", 1)[1]) if flag and ":" in flag else 0}
        where = f"{_EXTRA_ARGS} {args.engine_extra_args!r}"
    if ":" in args.train_device:
        if int(args.train_device.split(":", 1)[1]) in engine_gpus:
            return f"{_TRAIN_DEVICE} {args.train_device} and {where}"
        return None
    if _visible_gpus() == 1:
        return f"{_TRAIN_DEVICE} cuda and {where} on a machine with one GPU"
    return None


def _check_gpu_count(args: argparse.Namespace) -> None:
    """On a cluster started here: the GPUs Ray is asked to reserve must exist, or placement would wait
    (and fail after minutes) for GPUs that never come."""
    if args.ray_address or os.environ.get("RAY_ADDRESS") or args.colocate or args.debug_rollout_only \
            or args.debug_train_only:
        return
    trainer = args.actor_num_nodes * args.actor_num_gpus_per_node if args.train_device == "cuda" else 0
    engines = args.rollout_num_gpus if _ray_places_engines(args) else 0
    if trainer and engines and trainer + engines > (have := _visible_gpus()):
        raise ValueError(f"the trainer ({trainer} GPU(s): {_TRAINER_GPUS}) and the engines ({_ROLLOUT_GPUS} "
                         f"{engines}) need {trainer + engines} GPUs, and this machine has {have}: add {_COLOCATE} to "
                         "share them")


def _choose_weight_transport(args: argparse.Namespace) -> None:
    """Resolve --update-weight-transport / --update-weight-backend ``auto`` from where the trainer
    and the engines run (``weight_sync.arguments.resolve_transport``), refusing what cannot work."""
    from weight_sync.arguments import Placement, resolve_transport
    from weight_sync.interfaces import WeightSyncSettings, resolve_load_format

    if args.debug_rollout_only or args.debug_train_only:  # no push
        return
    where = Placement(trainer="cuda" if args.train_device.startswith("cuda") else "cpu",
                      engines=_engine_device(args), colocated=args.colocate, shared_gpu=_shared_gpu(args))
    transport, backend = resolve_transport(args.update_weight_transport, args.update_weight_backend, where)
    load_format = flag_of(WeightSyncSettings, "load_format")
    offload_params = flag_of(TrainerGroupSettings, "offload_train_params")
    if args.offload_train_params and args.update_weight_load_format == "mapped":
        raise ValueError(f"{load_format} mapped has the engines keep the trainer's parameters mapped, and "
                         f"{offload_params} frees them between pushes: drop one (auto picks flattened_bucket with "
                         f"{offload_params})")
    args.update_weight_load_format = resolve_load_format(args.update_weight_load_format, transport,
                                                         params_move=args.offload_train_params)
    if args.update_weight_load_format == "mapped" and transport != "tensor":
        raise ValueError(f"{load_format} mapped hands the engines handles they keep mapped, which needs "
                         f"{_COLOCATE} ({flag_of(WeightSyncSettings, 'transport')} tensor); this run's transport is "
                         f"{transport}")
    if where.shared_gpu and transport == "distributed" and args.update_weight_backend == "auto":
        log.warning("trainer rank 0 and an engine share a GPU (%s) without %s: weights go over gloo, through host "
                    "memory; %s hands them over as CUDA IPC handles and lends the engines' KV cache memory to the "
                    "trainer while it trains", where.shared_gpu, _COLOCATE, _COLOCATE)
    args.update_weight_transport, args.update_weight_backend = transport, backend
