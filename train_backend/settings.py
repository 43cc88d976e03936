"""The train backend's settings: every field with its flag (default, help, choices), its checks,
and the choices of each enumerated flag (``train_backend/arguments.py`` makes the parser from them).

Its own module, importing nothing of ours but :mod:`flags` (and :class:`~train_backend.lora.LoraSettings`,
whose module imports only :mod:`flags` at import time), so the backends, the losses and the
hooks read it without importing the factory in ``train_backend.interfaces`` (which imports the
backends).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from flags import SettingError, check_choice, flag
from train_backend.lora import LoraSettings

BACKENDS = ("torch", "megatron")
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gspo",
                        "cispo", "ppo")
# what only --advantage-estimator ppo reads (its critic): refused with another estimator
CRITIC_FLAGS = ("critic_load", "critic_lr", "value_clip", "num_critic_only_steps")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
# low_var_kl: slime's name for k3 clamped to [-10, 10] (its compute_approx_kl)
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")  # slime's; custom_loss: --custom-loss-function-path
OPTIMIZERS = ("adam", "sgd")  # Megatron's --optimizer; adam is AdamW (decoupled weight decay)
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "WSD")  # Megatron's names (WSD: warm-up, stable, decay)
LR_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")  # Megatron's --lr-wsd-decay-style
DTYPES = ("float32", "bfloat16")  # float16 would need loss scaling
# the built-in train/rollout corrections (train_backend/mismatch.py), by slime's function names:
# vanilla_tis_function, icepop_function, mis.py's compute_mis_weights
TIS_FUNCTIONS = ("vanilla", "icepop", "mis")
# slime's --opd-type: where the on-policy distillation teacher runs (megatron: in the trainer, not built here)
OPD_TYPES = ("sglang", "megatron")
MIS_LEVELS = ("token", "sequence", "geometric")  # mis.py's tis_level / rs_level
MIS_MODES = ("truncate", "clip", "mask")  # mis.py's tis_mode
# --tis-function mis's flags: slime reads them from mis.yaml (--custom-config-path), whose keys set
# them here too when the command line leaves them at their defaults (train_backend/arguments.py)
MIS_FLAGS = ("tis_level", "tis_mode", "tis_lower_bound", "tis_upper_bound", "use_rs", "rs_level", "rs_lower_bound",
             "rs_upper_bound", "rs_veto_threshold", "tis_batch_normalize")


G_OPT = "train: backend and optimizer"
G_LOSS = "train: RL loss"
G_HOOKS = "train: slime's trainer-side plugins (train_backend/hooks.py says where each is called and with what)"
_HOOK_HELP = "import path of the function"


@dataclass
class TrainSettings:
    """Everything a train backend needs. Each field declares its flag (:func:`flags.flag`: slime's
    names; default, help and choices in one place). ``hf_checkpoint``, ``rollout_temperature``,
    ``reward_key`` and ``seed`` are flags the rollout side declares; ``plugin_args`` is the
    namespace slime plugins get as ``args`` (the run's flags as a dict), set by the launcher, and
    so is ``flat_params`` (with ``--colocate`` and ``--update-weight-load-format mapped``).
    """

    hf_checkpoint: str = flag(declared_elsewhere=True)
    backend: str = flag("torch", "torch: the HF model (FSDP2 over several ranks); megatron: Megatron-core "
                        "(TP/PP/DP)", name="--train-backend", choices=BACKENDS, group=G_OPT)
    # optimizer and schedule (optimizer steps, not rollouts)
    lr: float = flag(1e-6, "peak learning rate (after --lr-warmup-iters)")
    min_lr: float = flag(0.0, "learning rate at the end of a linear, cosine or WSD decay")
    lr_warmup_steps: int = flag(0, "optimizer steps of linear warm-up", name="--lr-warmup-iters")
    lr_decay_style: str = flag("constant", "after warm-up: constant --lr, or a linear or cosine decay to --min-lr "
                               "over --lr-decay-iters; WSD (Megatron's): --lr until the last --lr-wsd-decay-iters "
                               "steps before --lr-decay-iters, then a decay to --min-lr", choices=LR_DECAY_STYLES)
    lr_decay_steps: int | None = flag(None, "optimizer steps to decay to --min-lr (linear/cosine/WSD)",
                                      name="--lr-decay-iters")
    lr_wsd_decay_steps: int | None = flag(None, "WSD: optimizer steps of the decay, the last ones before "
                                          "--lr-decay-iters", name="--lr-wsd-decay-iters")
    lr_wsd_decay_style: str = flag("exponential", "WSD: the decay's shape (Megatron's; its default)",
                                   choices=LR_WSD_DECAY_STYLES)
    optimizer: str = flag("adam", "adam: AdamW (decoupled weight decay, Megatron's adam); sgd: SGD with momentum "
                          "0.9 (Megatron's default --sgd-momentum)", choices=OPTIMIZERS)
    weight_decay: float = flag(0.0, "decoupled weight decay (AdamW's)")
    adam_beta1: float = flag(0.9, "Adam's decay rate of the gradient's running mean")
    adam_beta2: float = flag(0.98, "Adam's decay rate of the squared gradient's running mean")
    adam_eps: float = flag(1e-8, "Adam's term added to the denominator, for numerical stability")
    clip_grad: float = flag(1.0, "max grad norm (0 = no clipping)")
    # batching
    global_batch_size: int | None = flag(None, "samples per optimizer step (default: the whole rollout batch, one "
                                         "step per rollout)")
    max_tokens_per_micro_batch: int = flag(
        8192, "token budget of one packed micro-batch (per data-parallel rank); --max-tokens-per-gpu is slime's "
        "name (the same budget: no context parallelism here)", aliases=("--max-tokens-per-gpu",))
    # activation recomputation (Megatron's flags; the torch backend checkpoints every layer for "full")
    recompute_granularity: str | None = flag(
        None, "activation recomputation (Megatron's); the torch backend supports full (HF gradient checkpointing of "
        "every layer, i.e. --recompute-method uniform --recompute-num-layers 1)", choices=RECOMPUTE_GRANULARITIES)
    recompute_method: str | None = flag(None, "with --recompute-granularity full (Megatron's): uniform recomputes "
                                        "every block of --recompute-num-layers layers, block only the first "
                                        "--recompute-num-layers layers of each pipeline stage",
                                        choices=RECOMPUTE_METHODS)
    recompute_num_layers: int | None = flag(None, "layers per recomputed block (uniform) or recomputed layers per "
                                            "stage (block)")
    # advantages and policy loss
    advantage_estimator: str = flag("grpo", "how rewards become advantages (train_backend/losses.py): grpo and "
                                    "gspo (reward minus the group mean, over the group std; gspo clips "
                                    "sequence-level ratios), dr_grpo (no std), rloo (minus the mean of the group's "
                                    "other samples), reinforce_plus_plus (the reward) and "
                                    "reinforce_plus_plus_baseline (minus the group mean), both whitened over the "
                                    "batch (--normalize-advantages); cispo: grpo's advantages, MiniMax-M1's CISPO "
                                    "loss (the clipped ratio, no gradient, times the log-prob; --eps-clip 1 "
                                    "--eps-clip-high 4 is its one-sided setting); ppo: PPO with a critic (a second model with "
                                    "a value head, --critic-load), GAE advantages per token (--gamma, --lambd) and the "
                                    "clipped value loss (--value-clip)",
                                    choices=ADVANTAGE_ESTIMATORS, group=G_LOSS)
    gamma: float = flag(1.0, "ppo: GAE's discount factor (slime's)")
    lambd: float = flag(1.0, "ppo: GAE's lambda (slime's)")
    value_clip: float = flag(0.2, "ppo: the clip range of the critic's values around their values before the "
                             "update (slime's)")
    critic_load: str | None = flag(None, "ppo: HF checkpoint of the critic's model, which gets a new scalar value "
                                   "head on its last hidden state (default: --hf-checkpoint)")
    critic_lr: float | None = flag(None, "ppo: the critic's peak learning rate (default: --lr); its schedule has "
                                   "--lr's shape (warm-up, decay) scaled to it")
    num_critic_only_steps: int = flag(0, "ppo: the first rollouts train only the critic (slime's)")
    use_opd: bool = flag(False, "on-policy distillation (slime's OPD): each response token's advantage gets "
                         "-(--opd-kl-coef) x (student log-prob - teacher log-prob), the sampled reverse KL to the "
                         "teacher, before --normalize-advantages; with zero rewards (--rm-type zero) it is pure "
                         "distillation. The teacher scores the samples on the rollout side (--opd-teacher-url or "
                         "--opd-teacher-load)")
    opd_type: str | None = flag(None, "with --use-opd: sglang (the teacher is an engine speaking SGLang's HTTP API, "
                                "queried during the rollout); slime's megatron (a teacher inside the trainer) is not "
                                "built here", choices=OPD_TYPES)
    opd_kl_coef: float = flag(1.0, "with --use-opd: the weight of the reverse-KL term in the advantages (slime's)")
    normalize_advantages: bool = flag(False, "whiten advantages over all loss tokens of the rollout batch (required "
                                      "by reinforce_plus_plus and reinforce_plus_plus_baseline, as in slime)")
    eps_clip: float = flag(0.2, "PPO clip range of the importance ratio (lower; also upper without "
                           "--eps-clip-high)")
    eps_clip_high: float | None = flag(None, "clip-higher (default: --eps-clip)")
    eps_clip_c: float | None = flag(None, "dual-clip constant (> 1)")
    loss_agg: str = flag("token_mean", "how token losses are averaged: over all tokens of the step; per sequence, "
                         "then over sequences; or per sequence divided by a fixed length (Dr. GRPO)",
                         choices=LOSS_AGGREGATIONS)
    loss_agg_norm_length: int | None = flag(None, "divisor of seq_mean_token_sum_norm (default: "
                                            "--rollout-max-response-len)")
    # KL to the reference model, entropy bonus
    use_kl_loss: bool = flag(False, "add a KL loss to the reference policy (--ref-load), weighted by "
                             "--kl-loss-coef")
    kl_coef: float = flag(0.0, "coefficient of the KL loss (slime's)", name="--kl-loss-coef")
    kl_loss_type: str = flag("k3", "KL estimator of the KL loss (Schulman's k1, k2, k3; low_var_kl: k3 clamped to "
                             "[-10, 10], slime's)", choices=KL_LOSS_TYPES)
    # slime's --kl-coef: a KL penalty folded into the rewards of ppo / reinforce++ (not modelled: only 0)
    reward_kl_coef: float = flag(0.0, "slime's KL penalty in the rewards of ppo / reinforce++: only 0 here (see "
                                 "--kl-loss-coef)", name="--kl-coef")
    ref_load: str | None = flag(None, "HF checkpoint of the reference policy of the KL loss (default: "
                                "--hf-checkpoint)")
    entropy_coef: float = flag(0.0, "weight of the entropy bonus (subtracted from the loss)")
    # truncated importance sampling against the engine's log-probs
    use_tis: bool | None = flag(None, "truncated importance sampling against the engine's log-probs (default: on "
                                "in async mode, --max-weight-staleness > 0, where every group is a version or more "
                                "behind the weights it trains; off in sync mode; --no-use-tis turns it off; "
                                "docs/mismatch.md)")
    tis_cap: float = flag(2.0, "cap of the TIS weight (--tis-function vanilla and icepop)", name="--tis-clip")
    tis_clip_low: float = flag(0.0, "lower bound of the TIS weight (slime's; 0: none; vanilla and icepop)")
    get_mismatch_metrics: bool = flag(False, "log the train/rollout mismatch metrics of TIS (tis, tis_abs, "
                                      "tis_clipfrac, ois, or a --custom-tis-function-path's own) without --use-tis; "
                                      "the built-in TIS then leaves the loss unweighted, a custom function's result "
                                      "applies as in slime")
    tis_function: str = flag("vanilla", "the built-in correction (docs/mismatch.md): vanilla (truncated IS, "
                             "slime's vanilla_tis_function), icepop (ratios outside [--tis-clip-low, --tis-clip] "
                             "weighted 0, slime's icepop_function), mis (slime's mis.py: --tis-level, --tis-mode, "
                             "--use-rs...)", choices=TIS_FUNCTIONS)
    tis_level: str = flag("token", "mis: the ratio of each token, of its sequence (product) or their geometric mean",
                          choices=MIS_LEVELS)
    tis_mode: str = flag("truncate", "mis: truncate (cap at --tis-upper-bound), clip (to [--tis-lower-bound, "
                         "--tis-upper-bound]) or mask (reject the tokens outside)", choices=MIS_MODES)
    tis_lower_bound: float | None = flag(None, "mis: lower bound of clip and mask (default: 1 / --tis-upper-bound)")
    tis_upper_bound: float = flag(2.0, "mis: upper bound of the IS weight")
    use_rs: bool = flag(False, "mis: rejection sampling, tokens whose --rs-level ratio leaves [--rs-lower-bound, "
                        "--rs-upper-bound] are left out")
    rs_level: str = flag("token", "mis: the level of the rejection ratio", choices=MIS_LEVELS)
    rs_lower_bound: float | None = flag(None, "mis: rejection's lower bound (default: the TIS lower bound)")
    rs_upper_bound: float | None = flag(None, "mis: rejection's upper bound (default: --tis-upper-bound)")
    rs_veto_threshold: float | None = flag(None, "mis, with --use-rs: a sequence with a token ratio below this is "
                                           "rejected whole")
    tis_batch_normalize: bool = flag(False, "mis: divide the weights by their mean over the micro-batch (token or "
                                     "sequence level)")
    # slime's trainer-side plugins (train_backend/hooks.py); None = not set
    loss_type: str = flag("policy_loss", "policy_loss: the RL loss above; sft_loss: the negative log-likelihood of "
                          "the loss-mask tokens (supervised training, e.g. with --rollout-function-path "
                          "slime.rollout.sft_rollout.generate_rollout; --loss-agg aggregates it); custom_loss: "
                          "--custom-loss-function-path replaces the policy loss",
                          choices=LOSS_TYPES, group=G_HOOKS)
    custom_loss_function_path: str | None = flag(None, _HOOK_HELP)
    custom_advantage_function_path: str | None = flag(None, _HOOK_HELP)
    custom_tis_function_path: str | None = flag(None, _HOOK_HELP)
    custom_pg_loss_reducer_function_path: str | None = flag(None, _HOOK_HELP)
    custom_model_provider_path: str | None = flag(None, _HOOK_HELP)
    custom_megatron_init_path: str | None = flag(None, _HOOK_HELP)
    custom_megatron_before_log_prob_hook_path: str | None = flag(None, _HOOK_HELP)
    custom_megatron_before_train_step_hook_path: str | None = flag(None, _HOOK_HELP)
    custom_reward_post_process_path: str | None = flag(None, _HOOK_HELP)
    custom_convert_samples_to_train_data_path: str | None = flag(None, _HOOK_HELP)
    rollout_data_postprocess_path: str | None = flag(None, _HOOK_HELP)
    plugin_args: dict[str, Any] | None = None
    # --lora-rank and its flags (train_backend/lora.py declares them); None: off
    lora: LoraSettings | None = None
    # one buffer per dtype for the parameters of a single-process torch trainer: a colocated
    # ``mapped`` push then hands each engine one handle (set by the launcher, no flag)
    flat_params: bool = False
    # shared with the rollout side
    rollout_temperature: float = flag(1.0, declared_elsewhere=True)
    reward_key: str | None = flag(None, declared_elsewhere=True)
    # placement
    device: str = flag("cpu", "cpu, cuda, cuda:1, ...", name="--train-device", group=G_OPT)
    dtype: str = flag("float32", "compute dtype; master weights and optimizer state stay float32",
                      name="--train-dtype", choices=DTYPES)
    seed: int = flag(0, declared_elsewhere=True)
    save_hf: str | None = flag(None, "export an HF checkpoint at each save to this path pattern, e.g. "
                               "hf/{rollout_id}")

    def __post_init__(self) -> None:
        if self.use_tis is None:  # built in code: off (from flags, train_backend.arguments.use_tis_by_default decides)
            self.use_tis = False
        self.validate()

    def validate(self) -> None:
        """Raise :class:`flags.SettingError` naming the first bad field(s) (the flags, when built by
        ``flags.from_args``)."""
        check_choice(self, "backend", BACKENDS)
        check_choice(self, "advantage_estimator", ADVANTAGE_ESTIMATORS)
        check_choice(self, "loss_agg", LOSS_AGGREGATIONS)
        check_choice(self, "kl_loss_type", KL_LOSS_TYPES)
        check_choice(self, "lr_decay_style", LR_DECAY_STYLES)
        check_choice(self, "lr_wsd_decay_style", LR_WSD_DECAY_STYLES)
        check_choice(self, "dtype", DTYPES)
        check_choice(self, "optimizer", OPTIMIZERS)
        check_choice(self, "loss_type", LOSS_TYPES)
        self._validate_slime_flags()
        if (self.advantage_estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
                and not self.normalize_advantages):
            # slime asserts the same: these estimators leave the raw (or group-centred) reward unscaled
            raise SettingError(("advantage_estimator", "normalize_advantages"),
                               f"{{advantage_estimator}}={self.advantage_estimator} requires {{normalize_advantages}} "
                               "(whitening over the batch's loss tokens, as slime requires)")
        if not self.hf_checkpoint:
            raise SettingError("hf_checkpoint", "{hf_checkpoint} is required by the train backend")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise SettingError(("lr", "min_lr"), f"{{lr}}={self.lr}, {{min_lr}}={self.min_lr}: need 0 <= min-lr <= lr "
                                                 "and lr > 0")
        if self.lr_warmup_steps < 0:
            raise SettingError("lr_warmup_steps", f"{{lr_warmup_steps}}={self.lr_warmup_steps} must be >= 0")
        if self.lr_decay_style != "constant" and (self.lr_decay_steps is None or self.lr_decay_steps <= 0):
            raise SettingError(("lr_decay_style", "lr_decay_steps"),
                               f"{{lr_decay_style}}={self.lr_decay_style} needs {{lr_decay_steps}} > 0")
        if self.lr_decay_style == "WSD" and not (self.lr_wsd_decay_steps is not None
                                                 and 0 < self.lr_wsd_decay_steps <= self.lr_decay_steps):
            raise SettingError(("lr_decay_style", "lr_wsd_decay_steps"),
                               f"{{lr_decay_style}}=WSD needs 0 < {{lr_wsd_decay_steps}} <= {{lr_decay_steps}} "
                               f"(got {self.lr_wsd_decay_steps} and {self.lr_decay_steps})")
        if self.clip_grad < 0:
            raise SettingError("clip_grad", f"{{clip_grad}}={self.clip_grad} must be >= 0 (0 = no clipping)")
        if self.global_batch_size is not None and self.global_batch_size <= 0:
            raise SettingError("global_batch_size", f"{{global_batch_size}}={self.global_batch_size} must be > 0")
        if self.max_tokens_per_micro_batch <= 0:
            raise SettingError("max_tokens_per_micro_batch",
                               f"{{max_tokens_per_micro_batch}}={self.max_tokens_per_micro_batch} must be > 0")
        if self.advantage_estimator == "cispo":  # CISPO's lower bound 1 - eps-clip may be 0 (off): eps-clip >= 1
            if self.eps_clip <= 0:
                raise SettingError("eps_clip", f"{{eps_clip}}={self.eps_clip} must be > 0")
            if self.eps_clip_c is not None:
                raise SettingError(("eps_clip_c", "advantage_estimator"),
                                   "{eps_clip_c} is PPO's dual clip, which {advantage_estimator} cispo has not")
        elif not 0 < self.eps_clip < 1:
            raise SettingError("eps_clip", f"{{eps_clip}}={self.eps_clip} must be in (0, 1)")
        if self.eps_clip_high is not None and self.eps_clip_high <= 0:
            raise SettingError("eps_clip_high", f"{{eps_clip_high}}={self.eps_clip_high} must be > 0")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1:
            raise SettingError("eps_clip_c", f"{{eps_clip_c}}={self.eps_clip_c} must be > 1 (dual clip bounds -A * c)")
        if self.loss_agg_norm_length is not None and self.loss_agg_norm_length <= 0:
            raise SettingError("loss_agg_norm_length",
                               f"{{loss_agg_norm_length}}={self.loss_agg_norm_length} must be > 0")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise SettingError(("kl_coef", "entropy_coef"),
                               f"{{kl_coef}}={self.kl_coef}, {{entropy_coef}}={self.entropy_coef} must be >= 0")
        if self.kl_coef > 0 and not self.use_kl_loss:
            raise SettingError(("kl_coef", "use_kl_loss"),
                               f"{{kl_coef}}={self.kl_coef} has no effect without {{use_kl_loss}}")
        if self.tis_cap <= 0:
            raise SettingError("tis_cap", f"{{tis_cap}}={self.tis_cap} must be > 0")
        if not 0 <= self.tis_clip_low < self.tis_cap:
            raise SettingError(("tis_clip_low", "tis_cap"),
                               f"{{tis_clip_low}}={self.tis_clip_low} must be >= 0 and below {{tis_cap}}={self.tis_cap}")
        self._validate_tis_function()
        self._validate_critic()
        self._validate_opd()
        if self.rollout_temperature <= 0:
            raise SettingError("rollout_temperature", f"{{rollout_temperature}}={self.rollout_temperature} must be > 0")

    def _choice(self, field: str, allowed: tuple[str, ...]) -> None:
        value = getattr(self, field)
        if value not in allowed:
            raise SettingError(field, "{" + field + "}" + f"={value!r}: expected one of {', '.join(allowed)}")

    def _validate_tis_function(self) -> None:
        """--tis-function and mis.py's flags: a flag that would not be read is refused, naming it."""
        choice = self._choice
        choice("tis_function", TIS_FUNCTIONS)
        choice("tis_level", MIS_LEVELS)
        choice("rs_level", MIS_LEVELS)
        choice("tis_mode", MIS_MODES)
        if self.custom_tis_function_path and self.tis_function != "vanilla":
            raise SettingError(("tis_function", "custom_tis_function_path"),
                               f"{{tis_function}} {self.tis_function} and {{custom_tis_function_path}} both choose the "
                               "TIS function: give one")
        if self.tis_function != "vanilla" and not (self.use_tis or self.get_mismatch_metrics):
            raise SettingError(("tis_function", "use_tis", "get_mismatch_metrics"),
                               f"{{tis_function}} {self.tis_function} is only applied with {{use_tis}} (its metrics "
                               "alone: {get_mismatch_metrics})")
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in MIS_FLAGS}
        changed = tuple(n for n in MIS_FLAGS if getattr(self, n) != defaults[n])
        if changed and self.tis_function != "mis" and not self.custom_tis_function_path:
            raise SettingError((*changed, "tis_function", "custom_tis_function_path"),
                               "{" + "}, {".join(changed) + "} configure {tis_function} mis (or a "
                               f"{{custom_tis_function_path}} that reads them), not {self.tis_function}")
        if self.tis_function != "mis":
            return
        if self.tis_upper_bound <= 0:
            raise SettingError("tis_upper_bound", f"{{tis_upper_bound}}={self.tis_upper_bound} must be > 0")
        lower = self.tis_lower_bound if self.tis_lower_bound is not None else 1.0 / self.tis_upper_bound
        if self.tis_mode != "truncate" and not 0 <= lower < self.tis_upper_bound:
            raise SettingError(("tis_lower_bound", "tis_upper_bound"),
                               f"{{tis_lower_bound}}={lower} must be >= 0 and below {{tis_upper_bound}}="
                               f"{self.tis_upper_bound}")
        rs = ("rs_level", "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold")
        if not self.use_rs and any(getattr(self, n) != defaults[n] for n in rs):
            raise SettingError(("use_rs", *rs), "{rs_level}, {rs_lower_bound}, {rs_upper_bound} and "
                               "{rs_veto_threshold} have no effect without {use_rs}")
        if self.use_rs and not self.use_tis:
            raise SettingError(("use_rs", "use_tis"), "{use_rs} rejects tokens only with {use_tis} (mis.py returns "
                               "the metrics alone without it)")
        rs_low = self.rs_lower_bound if self.rs_lower_bound is not None else lower
        rs_high = self.rs_upper_bound if self.rs_upper_bound is not None else self.tis_upper_bound
        if self.use_rs and not rs_low < rs_high:
            raise SettingError(("rs_lower_bound", "rs_upper_bound"),
                               f"{{rs_lower_bound}}={rs_low} must be below {{rs_upper_bound}}={rs_high}")
        if self.rs_veto_threshold is not None and self.rs_veto_threshold <= 0:
            raise SettingError("rs_veto_threshold", f"{{rs_veto_threshold}}={self.rs_veto_threshold} must be > 0")
        if self.tis_batch_normalize and self.tis_level == "geometric":
            raise SettingError(("tis_batch_normalize", "tis_level"),
                               "{tis_batch_normalize} needs {tis_level} token or sequence (as in mis.py)")

    def _validate_opd(self) -> None:
        """slime's checks of the OPD flags (slime/utils/arguments.py), and what is not built here."""
        if not self.use_opd:
            changed = [n for n, default in (("opd_type", None), ("opd_kl_coef", 1.0)) if getattr(self, n) != default]
            if changed:
                raise SettingError((*changed, "use_opd"), "{" + "}, {".join(changed) + "} need(s) {use_opd}")
            return
        if self.opd_type is None:
            raise SettingError(("opd_type", "use_opd"), "{opd_type} must be given with {use_opd} (sglang: a teacher "
                               "engine scores the samples)")
        check_choice(self, "opd_type", OPD_TYPES)
        if self.opd_type == "megatron":
            raise SettingError(("opd_type",), "{opd_type} megatron (a teacher model inside the trainer) is not built "
                               "in Reservoir: use {opd_type} sglang with a teacher engine")
        if self.custom_advantage_function_path:
            raise SettingError(("use_opd", "custom_advantage_function_path"),
                               f"{{custom_advantage_function_path}} {self.custom_advantage_function_path} replaces "
                               "the advantages after {use_opd} adds its term here (slime adds it after the custom "
                               "function): not combined yet")
        if self.loss_type != "policy_loss":
            raise SettingError(("use_opd", "loss_type"), f"{{use_opd}} changes the advantages, which {{loss_type}} "
                               f"{self.loss_type} does not read")

    def _validate_critic(self) -> None:
        """--advantage-estimator ppo's flags: refused with another estimator or backend, naming them."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in CRITIC_FLAGS + ("gamma", "lambd")}
        if self.advantage_estimator != "ppo":
            changed = tuple(n for n in CRITIC_FLAGS if getattr(self, n) != defaults[n])
            if changed:
                raise SettingError((*changed, "advantage_estimator"),
                                   "{" + "}, {".join(changed) + "} configure the critic of {advantage_estimator} ppo, "
                                   f"not {self.advantage_estimator}")
            if (self.gamma, self.lambd) != (1.0, 1.0):  # reinforce_plus_plus here is slime's with gamma 1
                raise SettingError(("gamma", "lambd", "advantage_estimator"),
                                   "{gamma} and {lambd} are GAE's ({advantage_estimator} ppo), not "
                                   f"{self.advantage_estimator}'s")
            return
        if self.backend == "megatron":
            raise SettingError(("advantage_estimator", "backend"),
                               "{advantage_estimator} ppo (a critic) is built for {backend} torch only")
        if not (0 <= self.gamma <= 1 and 0 <= self.lambd <= 1):
            raise SettingError(("gamma", "lambd"), f"{{gamma}}={self.gamma} and {{lambd}}={self.lambd} must be in [0, 1]")
        if self.value_clip <= 0:
            raise SettingError("value_clip", f"{{value_clip}}={self.value_clip} must be > 0")
        if self.critic_lr is not None and self.critic_lr <= 0:
            raise SettingError("critic_lr", f"{{critic_lr}}={self.critic_lr} must be > 0")
        if self.num_critic_only_steps < 0:
            raise SettingError("num_critic_only_steps", f"{{num_critic_only_steps}}={self.num_critic_only_steps} must "
                               "be >= 0")
        if self.custom_advantage_function_path:
            raise SettingError(("custom_advantage_function_path", "advantage_estimator"),
                               "{custom_advantage_function_path} replaces the advantages that {advantage_estimator} "
                               "ppo computes from the critic's values: give one")
        if self.critic_load is not None:
            from pathlib import Path

            if not Path(self.critic_load, "config.json").is_file():
                raise SettingError("critic_load", f"{{critic_load}} {self.critic_load}: not an HF checkpoint (no "
                                   "config.json)")

    def _validate_slime_flags(self) -> None:
        """slime's flags whose values Reservoir cannot honour are refused here, naming why."""
        if self.loss_type == "custom_loss" and not self.custom_loss_function_path:
            raise SettingError(("loss_type", "custom_loss_function_path"),
                               "{loss_type} custom_loss needs {custom_loss_function_path}")
        if self.custom_loss_function_path and self.loss_type != "custom_loss":
            raise SettingError(("custom_loss_function_path", "loss_type"),
                               f"{{custom_loss_function_path}} {self.custom_loss_function_path} is only called with "
                               "{loss_type} custom_loss (as in slime)")
        if self.custom_tis_function_path and not (self.use_tis or self.get_mismatch_metrics):
            raise SettingError(("custom_tis_function_path", "use_tis", "get_mismatch_metrics"),
                               f"{{custom_tis_function_path}} {self.custom_tis_function_path} replaces the TIS "
                               "weights and is only called with {use_tis} or {get_mismatch_metrics}")
        if self.loss_type == "custom_loss":
            for field in ("custom_tis_function_path", "custom_pg_loss_reducer_function_path"):
                path = getattr(self, field)
                if path:
                    raise SettingError((field, "loss_type"),
                                       "{" + field + "}" + f" {path} is called by the policy loss, which "
                                       "{loss_type} custom_loss replaces (as in slime, it would never be called)")
        if self.loss_type == "sft_loss":  # slime's sft_loss_function reads only the log-probs and the mask
            unread = [f for f, on in (("use_kl_loss", self.use_kl_loss), ("entropy_coef", self.entropy_coef != 0),
                                      ("use_tis", self.use_tis), ("get_mismatch_metrics", self.get_mismatch_metrics),
                                      ("custom_tis_function_path", self.custom_tis_function_path),
                                      ("custom_pg_loss_reducer_function_path",
                                       self.custom_pg_loss_reducer_function_path)) if on]
            if unread:
                raise SettingError((*unread, "loss_type"), "{" + "}, {".join(unread) + "}: not read by {loss_type} "
                                   "sft_loss (the negative log-likelihood alone, as slime's sft_loss_function)")
        if self.backend == "torch" and self.custom_model_provider_path:
            raise SettingError(("custom_model_provider_path", "backend"),
                               f"{{custom_model_provider_path}} {self.custom_model_provider_path} builds a Megatron "
                               "model; the torch backend trains the HF model of {hf_checkpoint}: use {backend} "
                               "megatron")
        if self.custom_convert_samples_to_train_data_path and self.custom_reward_post_process_path:
            raise SettingError(("custom_reward_post_process_path", "custom_convert_samples_to_train_data_path"),
                               f"{{custom_reward_post_process_path}} {self.custom_reward_post_process_path} is called "
                               "by the default sample conversion, which {custom_convert_samples_to_train_data_path} "
                               "replaces (as in slime, it would never be called)")
        if self.reward_kl_coef != 0:
            raise SettingError("reward_kl_coef",
                               f"{{reward_kl_coef}} {self.reward_kl_coef}: in slime this is the KL penalty folded into "
                               "the rewards of {advantage_estimator} ppo / reinforce_plus_plus (a no-op for grpo), "
                               "which Reservoir does not model; the KL loss is {use_kl_loss} {kl_coef}")
        if self.recompute_granularity is not None and self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise SettingError("recompute_granularity",
                               f"{{recompute_granularity}}={self.recompute_granularity!r}: expected one of "
                               f"{', '.join(RECOMPUTE_GRANULARITIES)}")
        if self.recompute_method is not None and self.recompute_method not in RECOMPUTE_METHODS:
            raise SettingError("recompute_method", f"{{recompute_method}}={self.recompute_method!r}: expected one of "
                                                   f"{', '.join(RECOMPUTE_METHODS)}")
        if self.recompute_granularity == "full" and (self.recompute_method is None
                                                     or self.recompute_num_layers is None):
            raise SettingError(("recompute_granularity", "recompute_method", "recompute_num_layers"),
                               "{recompute_granularity} full needs {recompute_method} and {recompute_num_layers} "
                               "(as in Megatron)")
        if self.backend == "torch" and self.recompute_granularity is not None and (
                self.recompute_granularity != "full" or self.recompute_method != "uniform"
                or self.recompute_num_layers != 1):
            raise SettingError(("recompute_granularity", "recompute_method", "recompute_num_layers", "backend"),
                               f"{{recompute_granularity}} {self.recompute_granularity} {{recompute_method}} "
                               f"{self.recompute_method} {{recompute_num_layers}} {self.recompute_num_layers}: the "
                               "torch backend recomputes whole layers, one at a time (full / uniform / 1, HF gradient "
                               "checkpointing); other layouts need {backend} megatron")
        if self.ref_load is not None:
            from pathlib import Path

            if not Path(self.ref_load, "config.json").is_file():
                raise SettingError("ref_load",
                                   f"{{ref_load}} {self.ref_load}: not an HF checkpoint (no config.json). Reservoir's "
                                   "trainer reads HF checkpoints for the reference policy (slime's {ref_load} is a "
                                   "Megatron torch_dist checkpoint): pass the HF directory it was converted from, or "
                                   "leave {ref_load} out to use {hf_checkpoint}")

    @property
    def clip_high(self) -> float:
        """The upper clip range actually used (``eps_clip_high`` or, if unset, ``eps_clip``)."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high
