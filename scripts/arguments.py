"""The launcher's command line: every part's flags in one parser, ``--config`` defaults, and the
cross-part checks, done once at start-up with messages that name the flags.

Each part owns its flags (``<part>/arguments.py``: ``add_arguments(parser)`` and
``settings_from_args(args)``); this module owns only the launcher's own flags and composes.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from config import load_config_defaults


@dataclass
class LauncherSettings:
    """The driver's own settings (the loop, checkpoints, logging, debug modes)."""

    output_dir: str = "runs/latest"
    ray_address: str | None = None
    num_rollout: int = 10
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    eval_interval: int | None = None
    skip_eval_before_train: bool = False
    debug_rollout_only: bool = False
    debug_train_only: bool = False
    save_debug_rollout_data: str | None = None
    load_debug_rollout_data: str | None = None
    use_tensorboard: bool = False
    use_wandb: bool = False
    wandb_project: str | None = None
    buffer_name: str = "reservoir-buffer"
    colocate: bool = False
    no_plots: bool = False
    build_toy_model: bool = False
    toy_warmup_steps: int = 60


def _part_modules():
    import buffer.arguments
    import rollout_manager.arguments
    import train_backend.arguments
    import train_backend.megatron.arguments
    import weight_sync.arguments

    return [rollout_manager.arguments, buffer.arguments, train_backend.arguments,
            train_backend.megatron.arguments, weight_sync.arguments]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/train.py", description="Reservoir: RL post-training, end to end.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="YAML file of flag defaults (the command line overrides it)")
    d = LauncherSettings
    g = p.add_argument_group("launcher")
    g.add_argument("--output-dir", default=d.output_dir, help="metrics.jsonl, TensorBoard events, plots")
    g.add_argument("--ray-address", default=d.ray_address, help="join this Ray cluster (default: start a local one)")
    g.add_argument("--num-rollout", type=int, default=d.num_rollout, help="training steps (one rollout batch each)")
    g.add_argument("--save", default=d.save, help="checkpoint directory")
    g.add_argument("--load", default=d.load, help="resume from this checkpoint directory")
    g.add_argument("--save-interval", type=int, default=d.save_interval, help="steps between checkpoints")
    g.add_argument("--eval-interval", type=int, default=d.eval_interval, help="steps between evaluations")
    g.add_argument("--skip-eval-before-train", action="store_true", default=d.skip_eval_before_train)
    g.add_argument("--debug-rollout-only", action="store_true", default=d.debug_rollout_only,
                   help="generate and score only; no trainer")
    g.add_argument("--debug-train-only", action="store_true", default=d.debug_train_only,
                   help="train on --load-debug-rollout-data; no engines")
    g.add_argument("--save-debug-rollout-data", default=d.save_debug_rollout_data,
                   help="write each rollout batch to this path pattern, e.g. dumps/rollout_{rollout_id}.parquet")
    g.add_argument("--load-debug-rollout-data", default=d.load_debug_rollout_data,
                   help="read rollout batches from this path pattern instead of generating")
    g.add_argument("--use-tensorboard", action="store_true", default=d.use_tensorboard)
    g.add_argument("--use-wandb", action="store_true", default=d.use_wandb)
    g.add_argument("--wandb-project", default=d.wandb_project)
    g.add_argument("--buffer-name", default=d.buffer_name, help="name of the buffer actor")
    g.add_argument("--colocate", action="store_true", default=d.colocate,
                   help="trainer and engines share GPUs (not supported yet: rejected at start-up)")
    g.add_argument("--no-plots", action="store_true", default=d.no_plots, help="skip the PNG plots at the end")
    g.add_argument("--build-toy-model", action=argparse.BooleanOptionalAction, default=d.build_toy_model,
                   help="build the toy model (scripts/make_toy_model.py) at --hf-checkpoint if it is missing")
    g.add_argument("--toy-warmup-steps", type=int, default=d.toy_warmup_steps,
                   help="supervised warm-up steps when --build-toy-model builds it")
    for module in _part_modules():
        module.add_arguments(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` with ``--config`` defaults applied first; validate once; exit 2 on errors."""
    from rollout_manager.arguments import split_sglang_args

    parser = build_parser()
    # --sglang-* flags pass through to SGLang servers; their set depends on the installed SGLang
    argv, sglang_args = split_sglang_args(sys.argv[1:] if argv is None else list(argv))
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        try:
            parser.set_defaults(**load_config_defaults(parser, pre.config))
        except ValueError as e:
            parser.error(str(e))
    args = parser.parse_args(argv)
    args.sglang_args = sglang_args
    try:
        validate(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def launcher_settings_from_args(args: argparse.Namespace) -> LauncherSettings:
    return LauncherSettings(**{f: getattr(args, f) for f in LauncherSettings.__dataclass_fields__})


def validate(args: argparse.Namespace) -> None:
    """Cross-part checks; each part's own checks run in its ``settings_from_args``."""
    import rollout_manager.arguments

    for module in _part_modules():
        if module is rollout_manager.arguments:
            module.settings_from_args(args, args.sglang_args)
        else:
            module.settings_from_args(args)
    from train_backend.arguments import group_settings_from_args

    group_settings_from_args(args)  # trainer ranks vs. the backend's parallel layout
    ckpt = args.hf_checkpoint
    if not ckpt:
        raise ValueError("--hf-checkpoint is required (the model to train and serve)")
    if not args.build_toy_model and not Path(ckpt, "config.json").is_file():
        raise ValueError(f"--hf-checkpoint {ckpt}: no HF checkpoint there (config.json missing); "
                         "--build-toy-model builds the toy model at that path")
    if args.debug_rollout_only and args.debug_train_only:
        raise ValueError("--debug-rollout-only and --debug-train-only exclude each other")
    if args.debug_train_only and not args.load_debug_rollout_data:
        raise ValueError("--debug-train-only needs --load-debug-rollout-data")
    if args.load_debug_rollout_data and not args.debug_train_only:
        raise ValueError("--load-debug-rollout-data is only read with --debug-train-only")
    if args.num_rollout < 1:
        raise ValueError(f"--num-rollout must be >= 1, got {args.num_rollout}")
    for flag in ("save_interval", "eval_interval"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if args.save_interval and not args.save:
        raise ValueError("--save-interval needs --save (the checkpoint directory)")
    if args.eval_interval and not args.eval_prompt_data:
        raise ValueError("--eval-interval needs --eval-prompt-data")
    if args.colocate:  # engines would have to release GPU memory (/release_memory_occupation) while training
        raise ValueError("--colocate is not supported yet: run the trainer and the engines on separate devices")
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if args.global_batch_size is not None and samples % args.global_batch_size:
        raise ValueError(f"--global-batch-size {args.global_batch_size} must divide --rollout-batch-size x "
                         f"--n-samples-per-prompt = {samples}")
