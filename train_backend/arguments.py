"""The train backend's command-line flags (slime's names) and their conversion to
:class:`~train_backend.interfaces.TrainSettings`.

Shared flags defined by the rollout manager and read here: ``--hf-checkpoint``,
``--rollout-temperature``, ``--reward-key``, ``--seed``, ``--rollout-max-response-len``.
"""

from __future__ import annotations

import argparse

from train_backend.actor_group import TrainerGroupSettings
from train_backend.settings import (ADVANTAGE_ESTIMATORS, BACKENDS, DTYPES, HOOK_FLAGS, KL_LOSS_TYPES,
                                    LOSS_AGGREGATIONS, LOSS_TYPES, LR_DECAY_STYLES, OPTIMIZERS,
                                    RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, TrainSettings)

T = TrainSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the train backend's flags; defaults are :class:`TrainSettings`' field defaults."""
    g = parser.add_argument_group("train: backend and optimizer")
    g.add_argument("--train-backend", choices=BACKENDS, default=T.backend)
    g.add_argument("--lr", type=float, default=T.lr)
    g.add_argument("--min-lr", type=float, default=T.min_lr)
    g.add_argument("--lr-warmup-iters", type=int, default=T.lr_warmup_steps, help="optimizer steps of linear warm-up")
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default=T.lr_decay_style)
    g.add_argument("--lr-decay-iters", type=int, default=T.lr_decay_steps,
                   help="optimizer steps to decay to --min-lr (linear/cosine)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=T.optimizer,
                   help="adam: AdamW (decoupled weight decay, Megatron's adam); sgd: SGD with momentum 0.9 "
                        "(Megatron's default --sgd-momentum)")
    g.add_argument("--weight-decay", type=float, default=T.weight_decay)
    g.add_argument("--adam-beta1", type=float, default=T.adam_beta1)
    g.add_argument("--adam-beta2", type=float, default=T.adam_beta2)
    g.add_argument("--adam-eps", type=float, default=T.adam_eps)
    g.add_argument("--clip-grad", type=float, default=T.clip_grad, help="max grad norm (0 = no clipping)")
    g.add_argument("--global-batch-size", type=int, default=T.global_batch_size,
                   help="samples per optimizer step (default: the whole rollout batch, one step per rollout)")
    g.add_argument("--max-tokens-per-micro-batch", "--max-tokens-per-gpu", type=int,
                   default=T.max_tokens_per_micro_batch,
                   help="token budget of one packed micro-batch (per data-parallel rank); --max-tokens-per-gpu is "
                        "slime's name (the same budget: no context parallelism here)")
    g.add_argument("--use-dynamic-batch-size", action="store_true", default=True,
                   help="slime's flag for packing micro-batches by tokens (--max-tokens-per-gpu): always so here")
    g.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=T.recompute_granularity,
                   help="activation recomputation (Megatron's); the torch backend supports full (HF gradient "
                        "checkpointing of every layer, i.e. --recompute-method uniform --recompute-num-layers 1)")
    g.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, default=T.recompute_method)
    g.add_argument("--recompute-num-layers", type=int, default=T.recompute_num_layers)
    g.add_argument("--train-device", default=T.device, help="cpu, cuda, cuda:1, ...")
    g.add_argument("--train-dtype", choices=DTYPES, default=T.dtype)
    g.add_argument("--save-hf", default=T.save_hf,
                   help="export an HF checkpoint at each save to this path pattern, e.g. hf/{rollout_id}")

    G = TrainerGroupSettings
    g = parser.add_argument_group("train: ranks (Ray actors; one GPU each with --train-device cuda)")
    g.add_argument("--actor-num-nodes", type=int, default=G.actor_num_nodes, help="nodes of trainer ranks")
    g.add_argument("--actor-num-gpus-per-node", type=int, default=G.actor_num_gpus_per_node,
                   help="trainer ranks per node (one GPU each; on the CPU: CPU ranks over gloo)")
    g.add_argument("--offload-train", action=argparse.BooleanOptionalAction, default=G.offload_train,
                   help="keep the optimizer state (and fp32 master weights) in pinned host memory while the "
                        "engines generate (default: on with --colocate on GPUs)")

    g = parser.add_argument_group("train: RL loss")
    g.add_argument("--advantage-estimator", choices=ADVANTAGE_ESTIMATORS, default=T.advantage_estimator)
    g.add_argument("--normalize-advantages", action="store_true", default=T.normalize_advantages,
                   help="whiten advantages over all loss tokens of the rollout batch (required by "
                        "reinforce_plus_plus and reinforce_plus_plus_baseline, as in slime)")
    g.add_argument("--eps-clip", type=float, default=T.eps_clip)
    g.add_argument("--eps-clip-high", type=float, default=T.eps_clip_high, help="clip-higher (default: --eps-clip)")
    g.add_argument("--eps-clip-c", type=float, default=T.eps_clip_c, help="dual-clip constant (> 1)")
    g.add_argument("--loss-agg", choices=LOSS_AGGREGATIONS, default=T.loss_agg)
    g.add_argument("--loss-agg-norm-length", type=int, default=T.loss_agg_norm_length,
                   help="divisor of seq_mean_token_sum_norm (default: --rollout-max-response-len)")
    g.add_argument("--use-kl-loss", action="store_true", default=T.use_kl_loss)
    g.add_argument("--kl-loss-coef", type=float, default=T.kl_coef, help="coefficient of the KL loss (slime's)")
    g.add_argument("--kl-coef", type=float, default=T.reward_kl_coef,
                   help="slime's KL penalty in the rewards of ppo / reinforce++: only 0 here (see --kl-loss-coef)")
    g.add_argument("--ref-load", default=T.ref_load,
                   help="HF checkpoint of the reference policy of the KL loss (default: --hf-checkpoint)")
    g.add_argument("--kl-loss-type", choices=KL_LOSS_TYPES, default=T.kl_loss_type)
    g.add_argument("--entropy-coef", type=float, default=T.entropy_coef)
    g.add_argument("--use-tis", action="store_true", default=T.use_tis,
                   help="truncated importance sampling against the engine's log-probs")
    g.add_argument("--tis-clip", type=float, default=T.tis_cap, help="cap of the TIS weight")

    g = parser.add_argument_group("train: slime's trainer-side plugins (train_backend/hooks.py says where each is "
                                  "called and with what)")
    g.add_argument("--loss-type", choices=LOSS_TYPES, default=T.loss_type,
                   help="custom_loss: --custom-loss-function-path replaces the policy loss")
    for dest in HOOK_FLAGS:
        g.add_argument("--" + dest.replace("_", "-"), default=getattr(T, dest), help="import path of the function")
    g.add_argument("--custom-config-path", default=None,
                   help="YAML of extra attributes for every plugin's args (slime's); a key naming a flag is refused")


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    """Build and validate :class:`TrainSettings`; ``ValueError`` names the offending flags."""
    norm_length = args.loss_agg_norm_length
    if norm_length is None and args.loss_agg == "seq_mean_token_sum_norm":
        norm_length = args.rollout_max_response_len  # Dr. GRPO divides by the generation budget
    return TrainSettings(
        hf_checkpoint=args.hf_checkpoint, backend=args.train_backend, lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_style=args.lr_decay_style,
        lr_decay_steps=args.lr_decay_iters, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        global_batch_size=args.global_batch_size, max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
        advantage_estimator=args.advantage_estimator, normalize_advantages=args.normalize_advantages,
        eps_clip=args.eps_clip, eps_clip_high=args.eps_clip_high, eps_clip_c=args.eps_clip_c,
        loss_agg=args.loss_agg, loss_agg_norm_length=norm_length, use_kl_loss=args.use_kl_loss,
        kl_coef=args.kl_loss_coef, reward_kl_coef=args.kl_coef, ref_load=args.ref_load,
        kl_loss_type=args.kl_loss_type, entropy_coef=args.entropy_coef, optimizer=args.optimizer,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers, loss_type=args.loss_type,
        plugin_args=plugin_namespace(args), **{dest: getattr(args, dest) for dest in HOOK_FLAGS},
        use_tis=args.use_tis, tis_cap=args.tis_clip, rollout_temperature=args.rollout_temperature,
        reward_key=args.reward_key, device=args.train_device, dtype=args.train_dtype, seed=args.seed,
        save_hf=args.save_hf)


def plugin_namespace(args: argparse.Namespace) -> dict:
    """What trainer-side plugins get as ``args``: the flags' values (those Ray can ship to the
    ranks) plus the ``--custom-config-path`` YAML's attributes (start-up errors name the file)."""
    import pickle

    from slime_compat._args import custom_config

    out = {}
    for name, value in vars(args).items():
        try:
            pickle.dumps(value)
        except Exception:  # a launcher-only object: no plugin reads it
            continue
        out[name] = value
    out.update(custom_config(args))
    return out


def group_settings_from_args(args: argparse.Namespace) -> TrainerGroupSettings:
    """Build :class:`TrainerGroupSettings` and check it against the backend's settings (world
    size vs. TP x PP, a pinned device with several ranks); ``ValueError`` names the flags."""
    from train_backend.megatron.arguments import settings_from_args as megatron_settings

    group = TrainerGroupSettings(actor_num_nodes=args.actor_num_nodes,
                                 actor_num_gpus_per_node=args.actor_num_gpus_per_node,
                                 offload_train=args.offload_train)
    group.validate(settings_from_args(args), megatron_settings(args))
    return group
