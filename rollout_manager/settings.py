"""Typed settings of the rollout manager (every default lives here, once).

``arguments.py`` builds the command-line flags from these field defaults and turns a parsed
namespace into a ``RolloutSettings``. Components take the settings; only plugins see the
argparse namespace (slime's plugin contract).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataSettings:
    """Where prompts come from and how they become token ids."""

    prompt_data: str | None = None  # jsonl or parquet file
    input_key: str = "prompt"
    label_key: str | None = "label"
    metadata_key: str | None = "metadata"
    apply_chat_template: bool = False
    rollout_shuffle: bool = False
    rollout_seed: int = 42
    num_epoch: int | None = None  # None: cycle through epochs forever
    rollout_max_prompt_len: int | None = None  # prompts longer (in tokens) are skipped
    rollout_max_context_len: int | None = None  # slime's: prompt + response budget (caps the prompt at this - 1)
    strict_data: bool = False  # a bad line is an error instead of being skipped


# sglang-router policies a router started by the manager can use. Not power_of_two: sglang-router
# 0.3.2 exits at start-up with it unless 2+ workers are given on its command line, and the manager
# starts the router before it registers the engines.
ROUTER_POLICIES = ("random", "round_robin", "cache_aware")


@dataclass
class EngineFleetSettings:
    """Which engines serve generation and how they are reached."""

    rollout_engine: str = "embedded"  # "embedded", "sglang" or "instant" (no model, benchmarks)
    rollout_num_engines: int = 1  # engine count when no GPUs are used
    rollout_num_gpus: int = 0  # total GPUs for engines (sglang); 0 = CPU
    rollout_num_gpus_per_engine: int = 1
    rollout_engine_placement: str = "auto"  # "local" subprocesses, "ray" placement groups, auto: ray on GPUs
    engine_urls: list[str] = field(default_factory=list)  # running servers: start none
    sglang_router_ip: str | None = None  # a running router: start none
    sglang_router_port: int | None = None
    router_policy: str = "round_robin"  # sglang-router --policy for a router started here (ROUTER_POLICIES)
    sglang_args: list[str] = field(default_factory=list)  # --sglang-* pass-through, as SGLang server CLI tokens
    router_args: list[str] = field(default_factory=list)  # --sglang-router-* pass-through, as sglang-router tokens
    # The servers' --api-key / --admin-api-key (from --sglang-api-key / --sglang-admin-api-key, or
    # those of --engine-urls servers): every client of the engines sends them
    api_key: str | None = None
    admin_api_key: str | None = None
    # Filled by the launcher, no flags of their own: directories the embedded engines may load
    # pushed weights from (the disk transport's, the run's output) besides the model path, and
    # non-loopback trainer addresses they may join for weight updates (--update-weight-master-address)
    weight_update_dirs: list[str] = field(default_factory=list)
    weight_update_masters: list[str] = field(default_factory=list)
    engine_extra_args: str = ""  # extra flags for embedded/instant engines, e.g. "--max-running-requests 64"
    engine_startup_timeout: float = 300.0  # seconds for an engine to become healthy
    health_check_interval: float = 2.0  # seconds between engine health checks
    health_check_timeout: float = 10.0  # a busy engine may answer /health late; 3 misses in a row = hung
    restart_dead_engines: bool = True


# How the default rollout sends its requests (--rollout-request-granularity): "group" sends a
# prompt's unfinished samples as one batch /generate (n times fewer requests through the router and
# both HTTP stacks); "sample" sends each sample alone. Custom generate functions are per sample.
REQUEST_GRANULARITIES = ("group", "sample")


@dataclass
class SamplingSettings:
    """Generation settings of training rollouts and of evaluation."""

    n_samples_per_prompt: int = 1
    rollout_batch_size: int = 8  # groups kept per rollout step
    over_sampling_batch_size: int | None = None  # prompts started per refill (None: rollout_batch_size)
    rollout_max_response_len: int = 64
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    rollout_top_k: int = -1
    rollout_stop: list[str] = field(default_factory=list)
    rollout_stop_token_ids: list[int] = field(default_factory=list)
    rollout_skip_special_tokens: bool = False
    sglang_server_concurrency: int = 512  # in-flight requests per engine
    rollout_dispatch: str = "router"  # "router" or "direct" (least-loaded engine, no router hop)
    rollout_request_granularity: str = "group"  # REQUEST_GRANULARITIES
    request_timeout: float = 600.0  # seconds for one /generate call
    max_request_retries: int = 5  # retries of one request after engine errors
    max_dropped_ratio: float = 20.0  # a step fails after dropping this many x rollout_batch_size groups
    partial_rollout: bool = False
    mask_offpolicy_in_partial_rollout: bool = False
    eval_prompt_data: str | None = None
    eval_temperature: float = 0.0  # 0 = greedy
    n_samples_per_eval_prompt: int = 1
    eval_max_response_len: int | None = None  # None: rollout_max_response_len
    eval_max_context_len: int | None = None  # slime's (plugins read it); None: rollout_max_context_len


@dataclass
class PluginSettings:
    """Import paths of the plugins and the reward choice."""

    rollout_function_path: str = "rollout_manager.rollout.generate_rollout"
    custom_generate_function_path: str | None = None
    rm_type: str = "math"  # built-in reward (plugins.rewards.BUILTIN_RMS)
    rm_url: str | None = None  # remote reward model (overrides rm_type)
    custom_rm_path: str | None = None  # overrides rm_type
    group_rm: bool = False
    reward_key: str | None = None
    dynamic_sampling_filter_path: str | None = None
    # slime's other rollout-side hooks (docs/slime.md has each one's call site)
    data_source_path: str | None = None  # a class built as cls(args); None: Reservoir's data source
    eval_function_path: str | None = None  # the rollout function for evaluation; None: rollout_function_path
    rollout_sample_filter_path: str | None = None  # fn(args, kept_groups): sets Sample.remove_sample
    rollout_all_samples_process_path: str | None = None  # fn(args, all_finished_groups, get_samples)
    custom_rollout_log_function_path: str | None = None  # fn(rollout_id, args, samples, metrics, seconds) -> bool
    custom_eval_rollout_log_function_path: str | None = None  # fn(rollout_id, args, data, metrics) -> bool
    rollout_sample_hook_path: list[str] = field(default_factory=list)  # hook(args, sample, ...) after generate
    # Bounds on one plugin call (seconds); a call past its bound fails its sample or group, counted
    reward_timeout: float = 120.0  # one reward call (a sample's, or a group's with --group-rm)
    custom_generate_timeout: float = 3600.0  # one custom generate call (it may run many turns)
    filter_timeout: float = 120.0  # one call of a filter or a step hook (the three *-filter/process paths)


@dataclass
class RolloutSettings:
    """Everything the rollout manager needs; built by ``arguments.settings_from_args``."""

    hf_checkpoint: str | None = None
    data: DataSettings = field(default_factory=DataSettings)
    engines: EngineFleetSettings = field(default_factory=EngineFleetSettings)
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    plugins: PluginSettings = field(default_factory=PluginSettings)
    seed: int = 1234
