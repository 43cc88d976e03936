"""The train backend's command-line flags (slime's names) and their conversion to
:class:`~train_backend.interfaces.TrainSettings`.

Shared flags defined by the rollout manager and read here: ``--hf-checkpoint``,
``--rollout-temperature``, ``--reward-key``, ``--seed``, ``--rollout-max-response-len``; and the
buffer's ``--max-weight-staleness`` (async mode), which turns ``--use-tis`` on by default.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from flags import add_flags, flag_of, from_args, section
from train_backend.actor_group import TrainerGroupSettings
from train_backend.lora import LoraSettings
from train_backend.settings import G_HOOKS, G_OPT, MIS_FLAGS, TrainSettings

if TYPE_CHECKING:
    from train_backend.megatron.arguments import MegatronSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the train backend's flags: :class:`TrainSettings`' and :class:`TrainerGroupSettings`'
    fields declare them (``flags.flag``), plus two that set no field."""
    add_flags(parser, TrainSettings)
    g = section(parser, G_OPT)
    g.add_argument("--use-dynamic-batch-size", action="store_true", default=True,
                   help="slime's flag for packing micro-batches by tokens (--max-tokens-per-gpu): always so here")
    add_flags(parser, LoraSettings)
    add_flags(parser, TrainerGroupSettings, "train: ranks (Ray actors; one GPU each with --train-device cuda)")
    g = section(parser, G_HOOKS)
    g.add_argument("--custom-config-path", default=None,
                   help="YAML of extra attributes for every plugin's args (slime's); a key naming a flag must hold "
                        "its value, except mis.yaml's keys (--tis-level, --use-rs...), which set flags left at "
                        "their defaults")


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    """Build and validate :class:`TrainSettings`; ``ValueError`` names the offending flags."""
    adopt_mis_config(args)
    norm_length = args.loss_agg_norm_length
    if norm_length is None and args.loss_agg == "seq_mean_token_sum_norm":
        norm_length = args.rollout_max_response_len  # Dr. GRPO divides by the generation budget
    args.use_tis = use_tis_by_default(args)  # plugins (and mis.yaml's check) see the value in use, not None
    lora = from_args(LoraSettings, args)
    if lora.enabled and args.train_backend == "megatron":  # LoRA is built on the torch backend only
        raise ValueError(f"{flag_of(LoraSettings, 'rank')} {lora.rank}: LoRA is built on the torch backend only; "
                         f"{flag_of(TrainSettings, 'backend')} megatron refuses it (use torch)")
    return from_args(TrainSettings, args, loss_agg_norm_length=norm_length, plugin_args=plugin_namespace(args),
                     lora=lora if lora.enabled else None)  # None: off, as TrainSettings() says


def use_tis_by_default(args: argparse.Namespace) -> bool:
    """``--use-tis`` as given, else on exactly when the trainer consumes off-policy groups (async mode,
    ``--max-weight-staleness`` > 0). The old log-probs of the PPO ratio are the trainer's own, taken
    at the weights it is about to update, so without TIS nothing weighs a group by how far the
    policy moved since the engines sampled it: on the toy task async without it learned slower in
    every seed and missed the target in some (bench/RESULTS.md, e2e)."""
    if args.use_tis is not None:
        return bool(args.use_tis)
    return bool(getattr(args, "max_weight_staleness", None))


def adopt_mis_config(args: argparse.Namespace) -> None:
    """slime's ``mis.yaml`` (``--custom-config-path``) sets mis.py's attributes on ``args``; here they
    are flags (:data:`~train_backend.settings.MIS_FLAGS`), so each of its keys sets the flag when the
    command line left that at its default, and the run is configured with the value mis.py reads.
    A key whose flag was given another value stays refused (:func:`plugins.slime_args.custom_config`)."""
    from plugins.slime_args import custom_config

    defaults = {f.name: f.default for f in dataclasses.fields(TrainSettings) if f.name in MIS_FLAGS}
    values = {k: v for k, v in custom_config(argparse.Namespace(custom_config_path=args.custom_config_path)).items()
              if k in MIS_FLAGS} if getattr(args, "custom_config_path", None) else {}
    for key, value in values.items():
        if getattr(args, key, defaults[key]) == defaults[key]:
            setattr(args, key, value)


def plugin_namespace(args: argparse.Namespace) -> dict:
    """What trainer-side plugins get as ``args``: the flags' values (those Ray can ship to the
    ranks) plus the ``--custom-config-path`` YAML's attributes (start-up errors name the file)."""
    import pickle

    from plugins.slime_args import custom_config

    out = {}
    for name, value in vars(args).items():
        try:
            pickle.dumps(value)
        except Exception:  # a launcher-only object: no plugin reads it
            continue
        out[name] = value
    out.update(custom_config(args))
    return out


def group_settings_from_args(args: argparse.Namespace, train: TrainSettings | None = None,
                             megatron: "MegatronSettings | None" = None) -> TrainerGroupSettings:
    """Build :class:`TrainerGroupSettings` (``colocate`` from the launcher's ``--colocate``) and check
    it against the backend's settings (world size vs. TP x PP, a pinned device with several ranks),
    given or built here; ``ValueError`` names the flags."""
    from train_backend.megatron.arguments import settings_from_args as megatron_settings

    group = from_args(TrainerGroupSettings, args, colocate=bool(getattr(args, "colocate", False)))
    group.validate(train or settings_from_args(args), megatron or megatron_settings(args))
    return group
