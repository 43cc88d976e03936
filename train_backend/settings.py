"""The train backend's settings: every field with its default, its checks, and the choices of each
enumerated flag (flags in ``train_backend/arguments.py``).

Its own module, importing nothing of ours, so the backends, the losses and the hooks read it without
importing the factory in ``train_backend.interfaces`` (which imports the backends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BACKENDS = ("torch", "megatron")
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gspo")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
# low_var_kl: slime's name for k3 clamped to [-10, 10] (its compute_approx_kl)
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSS_TYPES = ("policy_loss", "custom_loss")  # custom_loss: --custom-loss-function-path (slime's)
OPTIMIZERS = ("adam", "sgd")  # Megatron's --optimizer; adam is AdamW (decoupled weight decay)
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
# slime's trainer-side plugin flags (dest names) -> what each is called with; train_backend/hooks.py
HOOK_FLAGS = ("custom_loss_function_path", "custom_advantage_function_path", "custom_tis_function_path",
              "custom_pg_loss_reducer_function_path", "custom_model_provider_path", "custom_megatron_init_path",
              "custom_megatron_before_log_prob_hook_path", "custom_megatron_before_train_step_hook_path",
              "custom_reward_post_process_path", "custom_convert_samples_to_train_data_path",
              "rollout_data_postprocess_path")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
DTYPES = ("float32", "bfloat16")  # float16 would need loss scaling


@dataclass
class TrainSettings:
    """Everything a train backend needs. Field defaults are the flag defaults (one place).

    The flag of each field is ``--`` + the field name with ``-`` for ``_`` (slime's names), except
    ``backend`` (``--train-backend``), ``tis_cap`` (``--tis-clip``), ``lr_warmup_steps`` /
    ``lr_decay_steps`` (Megatron's ``--lr-warmup-iters`` / ``--lr-decay-iters``), ``device`` and
    ``dtype`` (``--train-device``, ``--train-dtype``), ``kl_coef`` (slime's ``--kl-loss-coef``) and
    ``reward_kl_coef`` (slime's ``--kl-coef``). ``plugin_args`` is the namespace slime plugins get as
    ``args`` (the run's flags as a dict), set by the launcher.
    """

    hf_checkpoint: str
    backend: str = "torch"
    # optimizer and schedule (optimizer steps, not rollouts)
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    lr_decay_steps: int | None = None  # needed by linear/cosine: steps from 0 to reach min_lr
    optimizer: str = "adam"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # batching
    global_batch_size: int | None = None  # samples per optimizer step; None = the whole rollout batch
    max_tokens_per_micro_batch: int = 8192
    # activation recomputation (Megatron's flags; the torch backend checkpoints every layer for "full")
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # advantages and policy loss
    advantage_estimator: str = "grpo"
    # whiten advantages over all loss tokens of the rollout batch (slime's flag and default; the
    # REINFORCE++ estimators require it, as in slime)
    normalize_advantages: bool = False
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # None = eps_clip (symmetric); larger = DAPO's clip-higher
    eps_clip_c: float | None = None  # dual-clip constant (> 1) for negative advantages; None = off
    loss_agg: str = "token_mean"
    loss_agg_norm_length: int | None = None  # seq_mean_token_sum_norm divisor; None = longest response
    # KL to the reference model, entropy bonus
    use_kl_loss: bool = False
    kl_coef: float = 0.0  # --kl-loss-coef
    kl_loss_type: str = "k3"
    # slime's --kl-coef: a KL penalty folded into the rewards of ppo / reinforce++ (not modelled: only 0)
    reward_kl_coef: float = 0.0
    ref_load: str | None = None  # the reference policy's HF checkpoint; None = --hf-checkpoint
    entropy_coef: float = 0.0
    # truncated importance sampling against the engine's log-probs
    use_tis: bool = False
    tis_cap: float = 2.0
    # slime's trainer-side plugins (train_backend/hooks.py); None = not set
    loss_type: str = "policy_loss"
    custom_loss_function_path: str | None = None
    custom_advantage_function_path: str | None = None
    custom_tis_function_path: str | None = None
    custom_pg_loss_reducer_function_path: str | None = None
    custom_model_provider_path: str | None = None
    custom_megatron_init_path: str | None = None
    custom_megatron_before_log_prob_hook_path: str | None = None
    custom_megatron_before_train_step_hook_path: str | None = None
    custom_reward_post_process_path: str | None = None
    custom_convert_samples_to_train_data_path: str | None = None
    rollout_data_postprocess_path: str | None = None
    plugin_args: dict[str, Any] | None = None
    # shared with the rollout side
    rollout_temperature: float = 1.0
    reward_key: str | None = None
    # placement
    device: str = "cpu"
    dtype: str = "float32"  # compute dtype; master weights and optimizer state stay float32
    seed: int = 0
    # HF export path pattern (``{rollout_id}`` is filled in); None = no export
    save_hf: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag of the first bad field."""
        def choice(flag: str, value: object, allowed: tuple[str, ...]) -> None:
            if value not in allowed:
                raise ValueError(f"{flag}={value!r}: expected one of {', '.join(allowed)}")

        choice("--train-backend", self.backend, BACKENDS)
        choice("--advantage-estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        choice("--loss-agg", self.loss_agg, LOSS_AGGREGATIONS)
        choice("--kl-loss-type", self.kl_loss_type, KL_LOSS_TYPES)
        choice("--lr-decay-style", self.lr_decay_style, LR_DECAY_STYLES)
        choice("--train-dtype", self.dtype, DTYPES)
        choice("--optimizer", self.optimizer, OPTIMIZERS)
        choice("--loss-type", self.loss_type, LOSS_TYPES)
        self._validate_slime_flags()
        if (self.advantage_estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
                and not self.normalize_advantages):
            # slime asserts the same: these estimators leave the raw (or group-centred) reward unscaled
            raise ValueError(f"--advantage-estimator={self.advantage_estimator} requires --normalize-advantages "
                             "(whitening over the batch's loss tokens, as slime requires)")
        if not self.hf_checkpoint:
            raise ValueError("--hf-checkpoint is required by the train backend")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"--lr={self.lr}, --min-lr={self.min_lr}: need 0 <= min-lr <= lr and lr > 0")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"--lr-warmup-iters={self.lr_warmup_steps} must be >= 0")
        if self.lr_decay_style != "constant" and (self.lr_decay_steps is None or self.lr_decay_steps <= 0):
            raise ValueError(f"--lr-decay-style={self.lr_decay_style} needs --lr-decay-iters > 0")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad={self.clip_grad} must be >= 0 (0 = no clipping)")
        if self.global_batch_size is not None and self.global_batch_size <= 0:
            raise ValueError(f"--global-batch-size={self.global_batch_size} must be > 0")
        if self.max_tokens_per_micro_batch <= 0:
            raise ValueError(f"--max-tokens-per-micro-batch={self.max_tokens_per_micro_batch} must be > 0")
        if not 0 < self.eps_clip < 1:
            raise ValueError(f"--eps-clip={self.eps_clip} must be in (0, 1)")
        if self.eps_clip_high is not None and self.eps_clip_high <= 0:
            raise ValueError(f"--eps-clip-high={self.eps_clip_high} must be > 0")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1:
            raise ValueError(f"--eps-clip-c={self.eps_clip_c} must be > 1 (dual clip bounds -A * c)")
        if self.loss_agg_norm_length is not None and self.loss_agg_norm_length <= 0:
            raise ValueError(f"--loss-agg-norm-length={self.loss_agg_norm_length} must be > 0")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"--kl-loss-coef={self.kl_coef}, --entropy-coef={self.entropy_coef} must be >= 0")
        if self.kl_coef > 0 and not self.use_kl_loss:
            raise ValueError(f"--kl-loss-coef={self.kl_coef} has no effect without --use-kl-loss")
        if self.tis_cap <= 0:
            raise ValueError(f"--tis-clip={self.tis_cap} must be > 0")
        if self.rollout_temperature <= 0:
            raise ValueError(f"--rollout-temperature={self.rollout_temperature} must be > 0")

    def _validate_slime_flags(self) -> None:
        """slime's flags whose values Reservoir cannot honour are refused here, naming why."""
        if self.loss_type == "custom_loss" and not self.custom_loss_function_path:
            raise ValueError("--loss-type custom_loss needs --custom-loss-function-path")
        if self.custom_loss_function_path and self.loss_type != "custom_loss":
            raise ValueError(f"--custom-loss-function-path {self.custom_loss_function_path} is only called with "
                             "--loss-type custom_loss (as in slime)")
        if self.custom_tis_function_path and not self.use_tis:
            raise ValueError(f"--custom-tis-function-path {self.custom_tis_function_path} replaces the TIS weights "
                             "and is only called with --use-tis")
        if self.loss_type == "custom_loss":
            for flag, path in (("--custom-tis-function-path", self.custom_tis_function_path),
                               ("--custom-pg-loss-reducer-function-path", self.custom_pg_loss_reducer_function_path)):
                if path:
                    raise ValueError(f"{flag} {path} is called by the policy loss, which --loss-type custom_loss "
                                     "replaces (as in slime, it would never be called)")
        if self.backend == "torch" and self.custom_model_provider_path:
            raise ValueError(f"--custom-model-provider-path {self.custom_model_provider_path} builds a Megatron "
                             "model; the torch backend trains the HF model of --hf-checkpoint: use --train-backend "
                             "megatron")
        if self.custom_convert_samples_to_train_data_path and self.custom_reward_post_process_path:
            raise ValueError(f"--custom-reward-post-process-path {self.custom_reward_post_process_path} is called by "
                             "the default sample conversion, which --custom-convert-samples-to-train-data-path "
                             "replaces (as in slime, it would never be called)")
        if self.reward_kl_coef != 0:
            raise ValueError(f"--kl-coef {self.reward_kl_coef}: in slime this is the KL penalty folded into the "
                             "rewards of --advantage-estimator ppo / reinforce_plus_plus (a no-op for grpo), which "
                             "Reservoir does not model; the KL loss is --use-kl-loss --kl-loss-coef")
        if self.recompute_granularity is not None and self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"--recompute-granularity={self.recompute_granularity!r}: expected one of "
                             f"{', '.join(RECOMPUTE_GRANULARITIES)}")
        if self.recompute_method is not None and self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(f"--recompute-method={self.recompute_method!r}: expected one of "
                             f"{', '.join(RECOMPUTE_METHODS)}")
        if self.recompute_granularity == "full" and (self.recompute_method is None
                                                     or self.recompute_num_layers is None):
            raise ValueError("--recompute-granularity full needs --recompute-method and --recompute-num-layers "
                             "(as in Megatron)")
        if self.backend == "torch" and self.recompute_granularity is not None and (
                self.recompute_granularity != "full" or self.recompute_method != "uniform"
                or self.recompute_num_layers != 1):
            raise ValueError(f"--recompute-granularity {self.recompute_granularity} --recompute-method "
                             f"{self.recompute_method} --recompute-num-layers {self.recompute_num_layers}: the torch "
                             "backend recomputes whole layers, one at a time (full / uniform / 1, HF gradient "
                             "checkpointing); other layouts need --train-backend megatron")
        if self.ref_load is not None:
            from pathlib import Path

            if not Path(self.ref_load, "config.json").is_file():
                raise ValueError(f"--ref-load {self.ref_load}: not an HF checkpoint (no config.json). Reservoir's "
                                 "trainer reads HF checkpoints for the reference policy (slime's --ref-load is a "
                                 "Megatron torch_dist checkpoint): pass the HF directory it was converted from, or "
                                 "leave --ref-load out to use --hf-checkpoint")

    @property
    def clip_high(self) -> float:
        """The upper clip range actually used (``eps_clip_high`` or, if unset, ``eps_clip``)."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high
