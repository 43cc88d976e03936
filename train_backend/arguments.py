"""The train backend's command-line flags (slime's names) and their conversion to
:class:`~train_backend.interfaces.TrainSettings`.

Shared flags defined by the rollout manager and read here: ``--hf-checkpoint``,
``--rollout-temperature``, ``--reward-key``, ``--seed``, ``--rollout-max-response-len``.
"""

from __future__ import annotations

import argparse

from train_backend.actor_group import TrainerGroupSettings
from train_backend.interfaces import (ADVANTAGE_ESTIMATORS, BACKENDS, DTYPES, KL_LOSS_TYPES, LOSS_AGGREGATIONS,
                                      LR_DECAY_STYLES, TrainSettings)

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
    g.add_argument("--weight-decay", type=float, default=T.weight_decay)
    g.add_argument("--adam-beta1", type=float, default=T.adam_beta1)
    g.add_argument("--adam-beta2", type=float, default=T.adam_beta2)
    g.add_argument("--adam-eps", type=float, default=T.adam_eps)
    g.add_argument("--clip-grad", type=float, default=T.clip_grad, help="max grad norm (0 = no clipping)")
    g.add_argument("--global-batch-size", type=int, default=T.global_batch_size,
                   help="samples per optimizer step (default: the whole rollout batch, one step per rollout)")
    g.add_argument("--max-tokens-per-micro-batch", type=int, default=T.max_tokens_per_micro_batch,
                   help="token budget of one packed micro-batch (per data-parallel rank)")
    g.add_argument("--train-device", default=T.device, help="cpu, cuda, cuda:1, ...")
    g.add_argument("--train-dtype", choices=DTYPES, default=T.dtype)
    g.add_argument("--save-hf", default=T.save_hf,
                   help="export an HF checkpoint at each save to this path pattern, e.g. hf/{rollout_id}")

    G = TrainerGroupSettings
    g = parser.add_argument_group("train: ranks (Ray actors; one GPU each with --train-device cuda)")
    g.add_argument("--actor-num-nodes", type=int, default=G.actor_num_nodes, help="nodes of trainer ranks")
    g.add_argument("--actor-num-gpus-per-node", type=int, default=G.actor_num_gpus_per_node,
                   help="trainer ranks per node (one GPU each; on the CPU: CPU ranks over gloo)")

    g = parser.add_argument_group("train: RL loss")
    g.add_argument("--advantage-estimator", choices=ADVANTAGE_ESTIMATORS, default=T.advantage_estimator)
    g.add_argument("--normalize-advantages", action="store_true", default=T.normalize_advantages,
                   help="whiten advantages over all loss tokens of the rollout batch")
    g.add_argument("--eps-clip", type=float, default=T.eps_clip)
    g.add_argument("--eps-clip-high", type=float, default=T.eps_clip_high, help="clip-higher (default: --eps-clip)")
    g.add_argument("--eps-clip-c", type=float, default=T.eps_clip_c, help="dual-clip constant (> 1)")
    g.add_argument("--loss-agg", choices=LOSS_AGGREGATIONS, default=T.loss_agg)
    g.add_argument("--loss-agg-norm-length", type=int, default=T.loss_agg_norm_length,
                   help="divisor of seq_mean_token_sum_norm (default: --rollout-max-response-len)")
    g.add_argument("--use-kl-loss", action="store_true", default=T.use_kl_loss)
    g.add_argument("--kl-coef", type=float, default=T.kl_coef)
    g.add_argument("--kl-loss-type", choices=KL_LOSS_TYPES, default=T.kl_loss_type)
    g.add_argument("--entropy-coef", type=float, default=T.entropy_coef)
    g.add_argument("--use-tis", action="store_true", default=T.use_tis,
                   help="truncated importance sampling against the engine's log-probs")
    g.add_argument("--tis-clip", type=float, default=T.tis_cap, help="cap of the TIS weight")


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
        kl_coef=args.kl_coef, kl_loss_type=args.kl_loss_type, entropy_coef=args.entropy_coef,
        use_tis=args.use_tis, tis_cap=args.tis_clip, rollout_temperature=args.rollout_temperature,
        reward_key=args.reward_key, device=args.train_device, dtype=args.train_dtype, seed=args.seed,
        save_hf=args.save_hf)


def group_settings_from_args(args: argparse.Namespace) -> TrainerGroupSettings:
    """Build :class:`TrainerGroupSettings` and check it against the backend's settings (world
    size vs. TP x PP, a pinned device with several ranks); ``ValueError`` names the flags."""
    from train_backend.megatron.arguments import settings_from_args as megatron_settings

    group = TrainerGroupSettings(actor_num_nodes=args.actor_num_nodes,
                                 actor_num_gpus_per_node=args.actor_num_gpus_per_node)
    group.validate(settings_from_args(args), megatron_settings(args))
    return group
