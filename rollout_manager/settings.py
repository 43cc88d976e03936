"""Typed settings of the rollout manager: each field declares its flag (:mod:`flags`: default,
help, choices in one place).

``arguments.py`` makes the command-line flags from these fields and turns a parsed namespace into a
``RolloutSettings``. Each class checks its own fields as it is built (``__post_init__``), raising
:class:`flags.SettingError` (the flags' names when built from flags, the fields' in code).
Components take the settings; only plugins see the argparse namespace (slime's plugin contract).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from flags import SettingError, check_bound, check_choice, flag
from plugins.rewards import REMOTE_RMS


# slime's --loss-mask-type values that the SFT rollout (rollout_manager/sft.py) builds (not qwen3_5)
LOSS_MASK_TYPES = ("qwen", "qwen3", "distill_qwen")


@dataclass
class DataSettings:
    """Where prompts come from and how they become token ids."""

    prompt_data: str | None = flag(None, "prompts: a .jsonl or .parquet file", group="rollout: data")
    input_key: str = flag("prompt", "key of the prompt in each --prompt-data record: a string, or a list of "
                          "{role, content} messages (with --apply-chat-template)")
    label_key: str | None = flag("label", "key of the label the reward compares against (empty: no label)")
    metadata_key: str | None = flag("metadata", "key of an optional JSON object per record, kept as the sample's "
                                    "metadata for plugins")
    apply_chat_template: bool = flag(False, "format each prompt with the tokenizer's chat template (a string prompt "
                                     "becomes one user message), adding the generation prompt")
    rollout_shuffle: bool = flag(False, "shuffle the prompts, anew each epoch")
    rollout_seed: int = flag(42, "seed of the prompt shuffle (--rollout-shuffle)")
    num_epoch: int | None = flag(None, "passes over the prompts (default: forever)")
    rollout_max_prompt_len: int | None = flag(None, "prompts longer (in tokens) are skipped")
    rollout_max_context_len: int | None = flag(
        None, "slime's prompt + response budget: plugins read it (args.rollout_max_context_len), and "
        "--rollout-max-prompt-len defaults to it minus one")
    strict_data: bool = flag(False, "a malformed prompt line is an error (default: skip it and count it)")
    loss_mask_type: str = flag("qwen", "the SFT rollout's loss mask (slime's; rollout_manager/sft.py): qwen / qwen3, "
                               "the assistant turns' tokens after their generation prompt; distill_qwen, the last "
                               "message's content after the first message's prompt", choices=LOSS_MASK_TYPES)

    def __post_init__(self) -> None:
        check_bound(self, ">", 0, "rollout_max_prompt_len", "num_epoch")
        check_choice(self, "loss_mask_type", LOSS_MASK_TYPES)
        context = self.rollout_max_context_len
        if context is None:
            return
        if context < 2:
            raise SettingError("rollout_max_context_len", f"{{rollout_max_context_len}} must be >= 2, got {context}")
        if self.rollout_max_prompt_len is None:  # slime's default: at least one token left to generate
            self.rollout_max_prompt_len = context - 1
        elif self.rollout_max_prompt_len > context - 1:
            raise SettingError(("rollout_max_prompt_len", "rollout_max_context_len"),
                               f"{{rollout_max_prompt_len}} ({self.rollout_max_prompt_len}) must be below "
                               f"{{rollout_max_context_len}} ({context})")


# sglang-router policies a router started by the manager can use. Not power_of_two: sglang-router
# 0.3.2 exits at start-up with it unless 2+ workers are given on its command line, and the manager
# starts the router before it registers the engines.
ROUTER_POLICIES = ("random", "round_robin", "cache_aware")


@dataclass
class EngineFleetSettings:
    """Which engines serve generation and how they are reached."""

    rollout_engine: str = flag("embedded", "embedded (default), sglang (GPU), or instant (no model: benchmarks of "
                               "the client path)", choices=("embedded", "sglang", "instant"), group="rollout: engines")
    rollout_num_engines: int = flag(1, "engine count when no GPUs are used")
    rollout_num_gpus: int = flag(0, "total GPUs for engines (sglang); 0 = CPU")
    rollout_num_gpus_per_engine: int = flag(1, "GPUs per SGLang engine (its tensor-parallel size)")
    rollout_engine_placement: str = flag("auto", "local subprocesses, or Ray placement groups (one bundle of GPUs per "
                                         "engine); auto: Ray when --rollout-num-gpus > 0",
                                         choices=("auto", "local", "ray"))
    rollout_engine_ray_resources: list[str] = flag(
        help="NAME=AMOUNT Ray resources each engine's placement bundle asks for besides its GPUs, to keep the "
             "engines on the nodes started with them (ray start --resources); on the CPU they replace the "
             "sliver of a CPU a bundle takes (Ray placement only)", default_factory=list)
    engine_urls: list[str] = flag(help="running SGLang-compatible servers to use instead of starting engines",
                                  default_factory=list)
    engine_extra_args: str = flag("", "extra flags for each embedded (or instant) engine, as one string (its "
                                  "--api-key / --admin-api-key reach the engines through their environment)")
    sglang_router_ip: str | None = flag(None, "a running sglang-router (start none)")
    sglang_router_port: int | None = flag(None, "port of the running sglang-router at --sglang-router-ip (the two "
                                          "go together)")
    router_policy: str = flag("round_robin", "load balancing of the sglang-router started here (cache_aware keeps a "
                              "prompt's samples on one engine: good for SGLang's prefix cache, uneven on small "
                              "batches)", choices=ROUTER_POLICIES)
    engine_startup_timeout: float = flag(300.0, "seconds for an engine to become healthy")
    health_check_interval: float = flag(2.0, "seconds between engine health checks")
    health_check_timeout: float = flag(10.0, "seconds an engine may take to answer /health (3 misses in a row: "
                                       "restarted)")
    restart_dead_engines: bool = flag(True, "restart an engine that died or failed its health checks (it rejoins "
                                      "the router at the current weight version)")
    rollout_fleet_autoscale: bool = flag(False, "grow and shrink the fleet with the Ray cluster (Ray placement): a "
                                         "node that joins with room for engines gets them (up to "
                                         "--rollout-fleet-max-engines), the engines of a node that leaves are taken "
                                         "out of the fleet; the run goes on (docs/multinode.md)")
    rollout_fleet_max_engines: int = flag(8, "most engines the fleet grows to with --rollout-fleet-autoscale")
    sglang_args: list[str] = field(default_factory=list)  # --sglang-* pass-through, as SGLang server CLI tokens
    router_args: list[str] = field(default_factory=list)  # --sglang-router-* pass-through, as sglang-router tokens
    # The servers' --api-key / --admin-api-key (from --sglang-api-key / --sglang-admin-api-key, or
    # --engine-extra-args, or generated: arguments.with_engine_admin_key): every client of the engines sends them
    api_key: str | None = None
    admin_api_key: str | None = None
    # Filled by the launcher, no flags of their own: directories the embedded engines may load
    # pushed weights from (the disk transport's, the run's output) besides the model path, and
    # non-loopback trainer addresses they may join for weight updates (--update-weight-master-address)
    weight_update_dirs: list[str] = field(default_factory=list)
    weight_update_masters: list[str] = field(default_factory=list)
    # set by the launcher with --lora-rank: engines serve LoRA adapters of up to this rank on these
    # modules (None: any), SGLang's --enable-lora --max-lora-rank --lora-target-modules
    lora_rank: int = 0
    lora_target_modules: list[str] | None = None

    def ray_resources(self) -> dict[str, float]:
        """``rollout_engine_ray_resources`` as ``{name: amount}``; a ``SettingError`` when an item is malformed."""
        out: dict[str, float] = {}
        for item in self.rollout_engine_ray_resources:
            name, _, amount = (part.strip() for part in item.partition("="))
            try:
                out[name] = float(amount)
            except ValueError:
                out[name] = 0.0
            if not name or not out[name] > 0:
                raise SettingError("rollout_engine_ray_resources",
                                   f"{{rollout_engine_ray_resources}} {item!r}: expected NAME=AMOUNT, AMOUNT > 0 "
                                   "(e.g. rollout=1)")
        return out

    def __post_init__(self) -> None:
        check_bound(self, ">", 0, "rollout_num_engines", "rollout_num_gpus_per_engine", "engine_startup_timeout",
                    "health_check_interval", "health_check_timeout", "rollout_fleet_max_engines")
        local = self.rollout_engine_placement == "local" or (self.rollout_engine_placement == "auto"
                                                             and not self.rollout_num_gpus)
        if self.rollout_fleet_autoscale and (self.engine_urls or local):
            raise SettingError(("rollout_fleet_autoscale", "rollout_engine_placement"),
                               "{rollout_fleet_autoscale} places engines on the nodes that join the Ray cluster: it "
                               "needs {rollout_engine_placement} ray (or auto with GPUs), not local engines or "
                               "{engine_urls}")
        check_bound(self, ">=", 0, "rollout_num_gpus")
        self.ray_resources()  # a malformed NAME=AMOUNT fails here, naming the flag
        if (self.sglang_router_ip is None) != (self.sglang_router_port is None):
            raise SettingError(("sglang_router_ip", "sglang_router_port"),
                               "{sglang_router_ip} and {sglang_router_port} go together")
        if self.rollout_engine == "sglang" and self.rollout_num_gpus == 0 and not self.engine_urls:
            raise SettingError(("rollout_engine", "rollout_num_gpus"),
                               "{rollout_engine} sglang needs {rollout_num_gpus} > 0 (SGLang runs on GPUs)")
        if self.rollout_num_gpus and self.rollout_num_gpus % self.rollout_num_gpus_per_engine:
            raise SettingError(("rollout_num_gpus", "rollout_num_gpus_per_engine"),
                               f"{{rollout_num_gpus}} ({self.rollout_num_gpus}) must be a multiple of "
                               f"{{rollout_num_gpus_per_engine}} ({self.rollout_num_gpus_per_engine})")


# How the default rollout sends its requests (--rollout-request-granularity): "group" sends a
# prompt's unfinished samples as one batch /generate (n times fewer requests through the router and
# both HTTP stacks); "sample" sends each sample alone. Custom generate functions are per sample.
REQUEST_GRANULARITIES = ("group", "sample")
# The agent loop's generate function: what --agent-env makes the custom generate (rollout_manager/agent.py)
AGENT_GENERATE = "rollout_manager.agent.generate"
# --tito-check (rollout_manager/tito.py): off, or warn (count and log), or fail (hard errors fail the sample too)
TITO_MODES = ("off", "warn", "fail")


@dataclass
class SamplingSettings:
    """Generation settings of training rollouts and of evaluation."""

    n_samples_per_prompt: int = flag(1, "responses generated per prompt (the group size GRPO compares)",
                                     group="rollout: sampling")
    rollout_batch_size: int = flag(8, "groups per rollout step")
    over_sampling_batch_size: int | None = flag(None, "prompts started per refill (default: --rollout-batch-size)")
    rollout_max_response_len: int = flag(64, "most tokens generated per response (SGLang's max_new_tokens)")
    rollout_temperature: float = flag(1.0, "sampling temperature of rollouts; the trainer computes its log-probs at "
                                      "the same temperature")
    rollout_top_p: float = flag(1.0, "nucleus sampling: sample from the smallest set of tokens holding this "
                                "probability (1 = all)")
    rollout_top_k: int = flag(-1, "sample from the k most likely tokens (-1 = all)")
    rollout_stop: list[str] = flag(help="stop strings: generation ends at the first one (SGLang's stop)",
                                   default_factory=list)
    rollout_stop_token_ids: list[int] = flag(help="stop token ids, for stop tokens hard to write on a command line "
                                             "(SGLang's stop_token_ids)", default_factory=list)
    rollout_skip_special_tokens: bool = flag(False, "leave special tokens out of the response text (SGLang's "
                                             "skip_special_tokens)")
    sglang_server_concurrency: int = flag(512, "in-flight requests per engine")
    rollout_dispatch: str = flag("router", "router: every request through sglang-router; direct: the manager sends "
                                 "each to the least-loaded live engine (no router hop; retries go to another engine "
                                 "at once)", choices=("router", "direct"))
    rollout_request_granularity: str = flag(
        "group", "group: the default rollout sends a prompt's unfinished samples as one batch /generate (n times "
        "fewer requests; samples whose sampling params differ go separately); sample: one request per sample. "
        "Custom generate functions are always called per sample", choices=REQUEST_GRANULARITIES)
    request_timeout: float = flag(600.0, "seconds for one /generate call", name="--rollout-request-timeout")
    max_request_retries: int = flag(5, "retries of one request after engine errors", name="--rollout-max-retries")
    max_dropped_ratio: float = flag(20.0, "fail a step (instead of sampling forever) once the filter dropped this "
                                    "many times --rollout-batch-size groups",
                                    name="--dynamic-sampling-max-dropped-ratio")
    partial_rollout: bool = flag(False, "a response interrupted (e.g. by a weight update's pause) continues from its "
                                 "tokens so far under the new weights (default: it starts again)")
    mask_offpolicy_in_partial_rollout: bool = flag(False, "with --partial-rollout, tokens generated under older "
                                                   "weights stay as context but get no loss (loss mask 0)")
    eval_prompt_data: str | None = flag(None, "evaluation prompts (a .jsonl or .parquet file, read with the same "
                                        "keys as --prompt-data), evaluated every --eval-interval steps")
    eval_temperature: float = flag(0.0, "0 = greedy")
    n_samples_per_eval_prompt: int = flag(1, "responses generated per evaluation prompt")
    eval_max_response_len: int | None = flag(None, "default: --rollout-max-response-len")
    eval_max_context_len: int | None = flag(None, "slime's context budget for evaluation, read by plugins (default: "
                                            "--rollout-max-context-len)")
    tito_check: str = flag("off", "token-in-token-out check of finished samples (rollout_manager/tito.py): warn counts "
                           "and logs hard errors (ids other than the engine saw or produced, loss mask off the engine "
                           "outputs, history not append-only) and soft differences from the chat template's render "
                           "(rollout/tito/<kind>); fail also fails each sample with a hard error", choices=TITO_MODES)
    tito_check_fraction: float = flag(1.0, "share of finished samples --tito-check checks (drawn at random)")
    # set by the launcher with --lora-rank: the adapter every /generate names (SGLang's lora_path), so
    # rollouts and evaluation run on the base plus the trainer's adapter (sglang_protocol/lora_adapter.py)
    lora_path: str | None = None

    def __post_init__(self) -> None:
        check_bound(self, ">", 0, "n_samples_per_prompt", "rollout_batch_size", "over_sampling_batch_size",
                    "rollout_max_response_len", "sglang_server_concurrency", "request_timeout",
                    "n_samples_per_eval_prompt", "eval_max_response_len", "eval_max_context_len",
                    "max_dropped_ratio")
        check_bound(self, ">=", 0, "max_request_retries")
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < self.rollout_batch_size:
            raise SettingError(("over_sampling_batch_size", "rollout_batch_size"),
                               f"{{over_sampling_batch_size}} ({self.over_sampling_batch_size}) must be >= "
                               f"{{rollout_batch_size}} ({self.rollout_batch_size})")
        check_bound(self, ">=", 0, "rollout_temperature", "eval_temperature")
        if not 0 < self.rollout_top_p <= 1:
            raise SettingError("rollout_top_p", f"{{rollout_top_p}} must be in (0, 1], got {self.rollout_top_p}")
        if self.rollout_request_granularity not in REQUEST_GRANULARITIES:  # argparse checks the CLI, not code
            raise SettingError("rollout_request_granularity",
                               f"{{rollout_request_granularity}} {self.rollout_request_granularity!r}: choose one of "
                               f"{list(REQUEST_GRANULARITIES)}")
        if self.tito_check not in TITO_MODES:  # argparse checks the CLI, not code
            raise SettingError("tito_check", f"{{tito_check}} {self.tito_check!r}: choose one of {list(TITO_MODES)}")
        if not 0 < self.tito_check_fraction <= 1:
            raise SettingError("tito_check_fraction",
                               f"{{tito_check_fraction}} must be in (0, 1], got {self.tito_check_fraction}")
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise SettingError(("mask_offpolicy_in_partial_rollout", "partial_rollout"),
                               "{mask_offpolicy_in_partial_rollout} needs {partial_rollout}")


@dataclass
class PluginSettings:
    """Import paths of the plugins and the reward choice."""

    rollout_function_path: str = flag("rollout_manager.rollout.generate_rollout", "the rollout function, slime's "
                                      "generate_rollout(args, rollout_id, data_source, evaluation=False): one step's "
                                      "groups of samples", group="rollout: plugins and rewards")
    custom_generate_function_path: str | None = flag(None, "async generate(args, sample, sampling_params) -> Sample "
                                                     "that replaces the default rollout's one-sample generation "
                                                     "(multi-turn, tool calls)")
    rm_type: str = flag("math", "built-in reward: math, exact_match, toy_arithmetic, remote, and slime's deepscaler, "
                        "dapo (with --reward-key score), f1, gpqa, random, remote_rm and the boxed_<type> prefix "
                        "(plugins/rewards.py); ignored with --custom-rm-path, and with --rm-url unless it is remote "
                        "or remote_rm")
    rm_url: str | None = flag(None, "remote reward model (POST {prompt, response, label})")
    custom_rm_path: str | None = flag(None, "reward function rm(args, sample) -> float or dict, sync or async "
                                      "(with --group-rm: rm(args, samples) -> a list of them)")
    group_rm: bool = flag(False, "call --custom-rm-path once per group with all its samples")
    opd_teacher_url: str | None = flag(None, "on-policy distillation (--use-opd --opd-type sglang): the teacher, an "
                                       "engine speaking SGLang's HTTP API (its base URL), which scores every "
                                       "generated sample's tokens (/generate, max_new_tokens 0, return_logprob) "
                                       "into sample.teacher_log_probs; slime passes it as --rm-url to its reward "
                                       "function slime.rollout.on_policy_distillation.reward_func")
    opd_teacher_load: str | None = flag(None, "on-policy distillation: an HF checkpoint the rollout manager serves as "
                                        "the teacher, one more engine of --rollout-engine's kind (on the CPU: an "
                                        "embedded engine) outside the router, never sent weights; instead of "
                                        "--opd-teacher-url. (slime's flag loads a Megatron teacher for "
                                        "--opd-type megatron)")
    reward_key: str | None = flag(None, "with dict rewards, the key of the value that is the reward (advantages, "
                                  "metrics)")
    dynamic_sampling_filter_path: str | None = flag(None, "filter(args, group) -> bool or slime's DynamicFilterOutput "
                                                    "(keep, reason, keep_when_insufficient): whether a finished "
                                                    "group is kept")
    # Bounds on one plugin call (seconds); a call past its bound fails its sample or group, counted
    reward_timeout: float = flag(120.0, "seconds one reward call may take (a sample's, or a group's with --group-rm); "
                                 "past it the sample(s) fail with 'reward: timeout', counted. Plain (non-async) "
                                 "reward functions run in a thread, so a blocking one does not stall the rollout")
    custom_generate_timeout: float = flag(3600.0, "seconds one --custom-generate-function-path call may take; past it "
                                          "the sample fails with 'generate: timeout', counted")
    filter_timeout: float = flag(120.0, "seconds one call of --dynamic-sampling-filter-path, "
                                 "--rollout-sample-filter-path or --rollout-all-samples-process-path may take (they "
                                 "run in a thread); past it the group is dropped (or the hook skipped), counted as "
                                 "'filter: timeout'")
    # slime's other rollout-side hooks (docs/slime.md has each one's call site)
    data_source_path: str | None = flag(None, "a data source class, built as cls(args), with get_samples(n) / "
                                        "add_samples(groups) (e.g. a subclass of "
                                        "slime.rollout.data_source.RolloutDataSourceWithBuffer); default: Reservoir's",
                                        group="rollout: slime's other hooks (docs/slime.md)")
    eval_function_path: str | None = flag(None, "the rollout function for evaluation (default: "
                                          "--rollout-function-path)")
    rollout_sample_filter_path: str | None = flag(None, "fn(args, groups) called on each training step's kept groups "
                                                  "(default rollout); samples it marks remove_sample=True stay in "
                                                  "the batch with a zero loss mask")
    rollout_all_samples_process_path: str | None = flag(None, "fn(args, groups, get_samples) called on every "
                                                        "finished group of a training step, kept or filtered out "
                                                        "(default rollout)")
    rollout_sample_hook_path: list[str] = flag(help="hook(args, sample, *, rollout_id=None, evaluation=False) -> "
                                               "Sample | None on each generated sample before its reward, sync or "
                                               "async; repeat the flag for several (run in order)",
                                               action="append", default_factory=list)
    custom_rollout_log_function_path: str | None = flag(None, "fn(rollout_id, args, samples, extra_metrics, seconds) "
                                                        "-> bool after each rollout step; True: skip Reservoir's "
                                                        "rollout metrics for that step")
    custom_eval_rollout_log_function_path: str | None = flag(None, "fn(rollout_id, args, data, extra_metrics) -> bool "
                                                             "after each evaluation; True: skip Reservoir's eval "
                                                             "metrics")
    # The agent loop (rollout_manager/agent.py, docs/agent.md): a multi-turn custom generate
    agent_env: str | None = flag(None, "import path of an agent environment factory, called once as factory(args); "
                                 "the environment has start(sample) -> (messages, tools) and step(sample, reply) -> "
                                 "(messages, done, reward), sync or async (plugins.python_env.make_env: a Python "
                                 "tool). Sets --custom-generate-function-path to the agent loop (" + AGENT_GENERATE +
                                 ") unless that is given", group="rollout: agent loop (docs/agent.md)")
    agent_max_turns: int = flag(8, "most model turns of one --agent-env episode; the episode then ends (reason "
                                "max_turns, counted in rollout/agent/end/<reason>)")
    agent_max_env_tokens: int | None = flag(None, "most environment tokens (tool results, user turns) one episode may "
                                            "add; a step that would pass it ends the episode (reason env_tokens)")

    def __post_init__(self) -> None:
        # rm_type's own values: arguments.settings_from_args (plugins.rewards.check_rm_type names its flag)
        check_bound(self, ">", 0, "reward_timeout", "custom_generate_timeout", "filter_timeout", "agent_max_turns",
                    "agent_max_env_tokens")
        if self.agent_env and not self.custom_generate_function_path:  # the agent loop is a custom generate
            self.custom_generate_function_path = AGENT_GENERATE
        if self.rm_url and self.custom_rm_path:
            raise SettingError(("rm_url", "custom_rm_path"),
                               "{rm_url} and {custom_rm_path} were both given: choose one reward")
        if self.opd_teacher_url and self.opd_teacher_load:
            raise SettingError(("opd_teacher_url", "opd_teacher_load"),
                               "{opd_teacher_url} and {opd_teacher_load} were both given: choose one teacher")
        if self.opd_teacher_load is not None and not os.path.isfile(os.path.join(self.opd_teacher_load, "config.json")):
            raise SettingError("opd_teacher_load", f"{{opd_teacher_load}} {self.opd_teacher_load}: not an HF "
                               "checkpoint (no config.json)")
        if self.opd_teacher_url is not None and not self.opd_teacher_url.startswith(("http://", "https://")):
            raise SettingError("opd_teacher_url", f"{{opd_teacher_url}} {self.opd_teacher_url!r}: expected an "
                               "http(s):// URL")
        if self.group_rm and not self.custom_rm_path:
            raise SettingError(("group_rm", "custom_rm_path"),
                               "{group_rm} needs {custom_rm_path} (a batched reward function)")
        if self.rm_type in REMOTE_RMS and not self.rm_url and not self.custom_rm_path:
            raise SettingError(("rm_type", "rm_url"),
                               f"{{rm_type}} {self.rm_type} needs {{rm_url}} (the reward model's address)")


@dataclass
class RolloutSettings:
    """Everything the rollout manager needs; built by ``arguments.settings_from_args``."""

    hf_checkpoint: str | None = flag(None, "HF checkpoint the engines serve (and whose tokenizer encodes prompts)",
                                     group="rollout: data")
    data: DataSettings = field(default_factory=DataSettings)
    engines: EngineFleetSettings = field(default_factory=EngineFleetSettings)
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    plugins: PluginSettings = field(default_factory=PluginSettings)
    seed: int = flag(1234, "random seed: the trainer's torch, numpy and random seeds; engine i samples with seed "
                     "+ i", group="rollout: data")


@dataclass
class RolloutLoopSettings:
    """How many rollout steps an entry point runs and which Ray cluster it joins: declared once
    here for both entry points, whose own settings extend this class (``LauncherSettings`` in
    ``scripts/arguments.py``, ``CliSettings`` in ``rollout_manager/__main__.py``, which overrides
    the defaults for a standalone run and says why). No section of its own: each entry point adds
    these flags to its own."""

    ray_address: str | None = flag(None, "join this Ray cluster ('auto': the one `ray start` began on this "
                                   "machine; unset: $RAY_ADDRESS's, else a new local one)")
    num_rollout: int = flag(10, "rollout steps, one rollout batch each (the launcher trains on each)")

    def __post_init__(self) -> None:
        check_bound(self, ">=", 1, "num_rollout")
