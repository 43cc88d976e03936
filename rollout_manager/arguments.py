"""Command-line flags of the rollout manager (slime's names) and their validation.

``add_arguments`` adds the flags this part owns to a parser (the launcher composes every part's
flags into one parser); defaults come from the settings dataclasses. ``settings_from_args``
validates flag combinations (``ValueError`` naming the flags) and builds ``RolloutSettings``.

SGLang server flags pass through as ``--sglang-<flag> [value]`` (e.g. ``--sglang-mem-fraction-static
0.8``): ``split_sglang_args`` pulls them out of ``argv`` before parsing, because their set depends
on the installed SGLang version.
"""

from __future__ import annotations

import argparse
from typing import Any

from rollout_manager.settings import (REQUEST_GRANULARITIES, ROUTER_POLICIES, DataSettings, EngineFleetSettings, PluginSettings,
                                      RolloutSettings, SamplingSettings)

D, E, S, P = DataSettings, EngineFleetSettings, SamplingSettings, PluginSettings

# Flags of ours that start with --sglang- (everything else with that prefix is passed through).
_OWN_SGLANG_FLAGS = ("--sglang-router-ip", "--sglang-router-port", "--sglang-server-concurrency")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the rollout manager's flags (and the shared ones it owns) to ``parser``."""
    g = parser.add_argument_group("rollout: data")
    g.add_argument("--hf-checkpoint", default=RolloutSettings.hf_checkpoint,
                   help="HF checkpoint the engines serve (and whose tokenizer encodes prompts)")
    g.add_argument("--prompt-data", default=D.prompt_data, help="prompts: a .jsonl or .parquet file")
    g.add_argument("--input-key", default=D.input_key)
    g.add_argument("--label-key", default=D.label_key)
    g.add_argument("--metadata-key", default=D.metadata_key)
    g.add_argument("--apply-chat-template", action="store_true", default=D.apply_chat_template)
    g.add_argument("--rollout-shuffle", action="store_true", default=D.rollout_shuffle)
    g.add_argument("--rollout-seed", type=int, default=D.rollout_seed)
    g.add_argument("--num-epoch", type=int, default=D.num_epoch, help="passes over the prompts (default: forever)")
    g.add_argument("--rollout-max-prompt-len", type=int, default=D.rollout_max_prompt_len)
    g.add_argument("--strict-data", action="store_true", default=D.strict_data,
                   help="a malformed prompt line is an error (default: skip it and count it)")
    g.add_argument("--seed", type=int, default=RolloutSettings.seed)

    g = parser.add_argument_group("rollout: engines")
    g.add_argument("--rollout-engine", choices=["embedded", "sglang", "instant"], default=E.rollout_engine,
                   help="embedded (default), sglang (GPU), or instant (no model: benchmarks of the client path)")
    g.add_argument("--rollout-num-engines", type=int, default=E.rollout_num_engines,
                   help="engine count when no GPUs are used")
    g.add_argument("--rollout-num-gpus", type=int, default=E.rollout_num_gpus)
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=E.rollout_num_gpus_per_engine)
    g.add_argument("--rollout-engine-placement", choices=["auto", "local", "ray"], default=E.rollout_engine_placement,
                   help="local subprocesses, or Ray placement groups (one bundle of GPUs per engine); "
                        "auto: Ray when --rollout-num-gpus > 0")
    g.add_argument("--engine-urls", nargs="+", default=list(E().engine_urls),
                   help="running SGLang-compatible servers to use instead of starting engines")
    g.add_argument("--engine-extra-args", default=E.engine_extra_args,
                   help="extra flags for each embedded (or instant) engine, as one string")
    g.add_argument("--sglang-router-ip", default=E.sglang_router_ip, help="a running sglang-router")
    g.add_argument("--sglang-router-port", type=int, default=E.sglang_router_port)
    # ROUTER_POLICIES: not power_of_two (see settings.py; tests/test_router.py starts each choice)
    g.add_argument("--router-policy", default=E.router_policy, choices=list(ROUTER_POLICIES),
                   help="load balancing of the sglang-router started here (cache_aware keeps a prompt's "
                        "samples on one engine: good for SGLang's prefix cache, uneven on small batches)")
    g.add_argument("--engine-startup-timeout", type=float, default=E.engine_startup_timeout)
    g.add_argument("--health-check-interval", type=float, default=E.health_check_interval)
    g.add_argument("--health-check-timeout", type=float, default=E.health_check_timeout,
                   help="seconds an engine may take to answer /health (3 misses in a row: restarted)")
    g.add_argument("--restart-dead-engines", action=argparse.BooleanOptionalAction, default=E.restart_dead_engines)

    g = parser.add_argument_group("rollout: sampling")
    g.add_argument("--n-samples-per-prompt", type=int, default=S.n_samples_per_prompt)
    g.add_argument("--rollout-batch-size", type=int, default=S.rollout_batch_size, help="groups per rollout step")
    g.add_argument("--over-sampling-batch-size", type=int, default=S.over_sampling_batch_size)
    g.add_argument("--rollout-max-response-len", type=int, default=S.rollout_max_response_len)
    g.add_argument("--rollout-temperature", type=float, default=S.rollout_temperature)
    g.add_argument("--rollout-top-p", type=float, default=S.rollout_top_p)
    g.add_argument("--rollout-top-k", type=int, default=S.rollout_top_k)
    g.add_argument("--rollout-stop", nargs="+", default=list(S().rollout_stop))
    g.add_argument("--rollout-stop-token-ids", type=int, nargs="+", default=list(S().rollout_stop_token_ids))
    g.add_argument("--rollout-skip-special-tokens", action="store_true", default=S.rollout_skip_special_tokens)
    g.add_argument("--sglang-server-concurrency", type=int, default=S.sglang_server_concurrency,
                   help="in-flight requests per engine")
    g.add_argument("--rollout-dispatch", choices=["router", "direct"], default=S.rollout_dispatch,
                   help="router: every request through sglang-router; direct: the manager sends each to the "
                        "least-loaded live engine (no router hop; retries go to another engine at once)")
    g.add_argument("--rollout-request-granularity", choices=list(REQUEST_GRANULARITIES),
                   default=S.rollout_request_granularity,
                   help="group: the default rollout sends a prompt's unfinished samples as one batch /generate "
                        "(n times fewer requests; samples whose sampling params differ go separately); sample: "
                        "one request per sample. Custom generate functions are always called per sample")
    g.add_argument("--rollout-request-timeout", type=float, default=S.request_timeout)
    g.add_argument("--rollout-max-retries", type=int, default=S.max_request_retries)
    g.add_argument("--dynamic-sampling-max-dropped-ratio", type=float, default=S.max_dropped_ratio,
                   help="fail a step (instead of sampling forever) once the filter dropped this many times "
                        "--rollout-batch-size groups")
    g.add_argument("--partial-rollout", action="store_true", default=S.partial_rollout)
    g.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true",
                   default=S.mask_offpolicy_in_partial_rollout)
    g.add_argument("--eval-prompt-data", default=S.eval_prompt_data)
    g.add_argument("--eval-temperature", type=float, default=S.eval_temperature)
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=S.n_samples_per_eval_prompt)
    g.add_argument("--eval-max-response-len", type=int, default=S.eval_max_response_len)

    g = parser.add_argument_group("rollout: plugins and rewards")
    g.add_argument("--rollout-function-path", default=P.rollout_function_path)
    g.add_argument("--custom-generate-function-path", default=P.custom_generate_function_path)
    g.add_argument("--rm-type", default=P.rm_type, help="built-in reward: math, exact_match, toy_arithmetic, remote "
                   "(ignored with --custom-rm-path or --rm-url)")
    g.add_argument("--rm-url", default=P.rm_url, help="remote reward model (POST {prompt, response, label})")
    g.add_argument("--custom-rm-path", default=P.custom_rm_path)
    g.add_argument("--group-rm", action="store_true", default=P.group_rm)
    g.add_argument("--reward-key", default=P.reward_key)
    g.add_argument("--dynamic-sampling-filter-path", default=P.dynamic_sampling_filter_path)


def split_sglang_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into (ours, SGLang's): ``--sglang-X [v]`` becomes ``--X [v]`` for the server."""
    ours: list[str] = []
    theirs: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name = tok.split("=", 1)[0]
        if tok.startswith("--sglang-") and name not in _OWN_SGLANG_FLAGS:
            theirs.append("--" + tok[len("--sglang-"):])
            if "=" not in tok and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                theirs.append(argv[i + 1])
                i += 1
        else:
            ours.append(tok)
        i += 1
    return ours, theirs


def _positive(args: argparse.Namespace, *names: str) -> None:
    for n in names:
        v = vars(args)[n]
        if v is not None and v <= 0:
            raise ValueError(f"--{n.replace('_', '-')} must be > 0, got {v}")


def settings_from_args(args: argparse.Namespace, sglang_args: list[str] | None = None) -> RolloutSettings:
    """Validate the rollout flags in ``args`` and build the settings (``ValueError`` names the flags)."""
    _positive(args, "n_samples_per_prompt", "rollout_batch_size", "over_sampling_batch_size",
              "rollout_max_response_len", "rollout_num_engines", "rollout_num_gpus_per_engine",
              "sglang_server_concurrency", "rollout_request_timeout", "n_samples_per_eval_prompt",
              "eval_max_response_len", "rollout_max_prompt_len", "num_epoch", "engine_startup_timeout",
              "health_check_interval", "health_check_timeout", "dynamic_sampling_max_dropped_ratio")
    if args.rollout_max_retries < 0:
        raise ValueError(f"--rollout-max-retries must be >= 0, got {args.rollout_max_retries}")
    if args.rollout_num_gpus < 0:
        raise ValueError(f"--rollout-num-gpus must be >= 0, got {args.rollout_num_gpus}")
    if args.over_sampling_batch_size is not None and args.over_sampling_batch_size < args.rollout_batch_size:
        raise ValueError(f"--over-sampling-batch-size ({args.over_sampling_batch_size}) must be >= "
                         f"--rollout-batch-size ({args.rollout_batch_size})")
    for flag in ("rollout_temperature", "eval_temperature"):
        if vars(args)[flag] < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got {vars(args)[flag]}")
    if not 0 < args.rollout_top_p <= 1:
        raise ValueError(f"--rollout-top-p must be in (0, 1], got {args.rollout_top_p}")
    if args.rollout_request_granularity not in REQUEST_GRANULARITIES:  # argparse checks the CLI; not other callers
        raise ValueError(f"--rollout-request-granularity {args.rollout_request_granularity!r}: choose one of "
                         f"{list(REQUEST_GRANULARITIES)}")
    if args.mask_offpolicy_in_partial_rollout and not args.partial_rollout:
        raise ValueError("--mask-offpolicy-in-partial-rollout needs --partial-rollout")
    if (args.sglang_router_ip is None) != (args.sglang_router_port is None):
        raise ValueError("--sglang-router-ip and --sglang-router-port go together")
    if args.rm_url and args.custom_rm_path:
        raise ValueError("choose one reward: --rm-url and --custom-rm-path were both given")
    if args.group_rm and not args.custom_rm_path:
        raise ValueError("--group-rm needs --custom-rm-path (a batched reward function)")
    from plugins.rewards import BUILTIN_RMS
    if args.rm_type not in BUILTIN_RMS:
        raise ValueError(f"--rm-type {args.rm_type!r}: choose one of {sorted(BUILTIN_RMS)}")
    if args.rollout_engine == "sglang" and args.rollout_num_gpus == 0 and not args.engine_urls:
        raise ValueError("--rollout-engine sglang needs --rollout-num-gpus > 0 (SGLang runs on GPUs)")
    if args.rollout_num_gpus and args.rollout_num_gpus % args.rollout_num_gpus_per_engine:
        raise ValueError(f"--rollout-num-gpus ({args.rollout_num_gpus}) must be a multiple of "
                         f"--rollout-num-gpus-per-engine ({args.rollout_num_gpus_per_engine})")
    if sglang_args and args.rollout_engine != "sglang":
        raise ValueError(f"--sglang-* flags {sglang_args} need --rollout-engine sglang")
    a: dict[str, Any] = vars(args)
    data = DataSettings(**{k: a[k] for k in DataSettings.__dataclass_fields__})
    engines = EngineFleetSettings(
        **{k: a[k] for k in EngineFleetSettings.__dataclass_fields__ if k != "sglang_args"},
        sglang_args=list(sglang_args or []))
    sampling = SamplingSettings(
        **{k: a[k] for k in SamplingSettings.__dataclass_fields__
           if k not in ("request_timeout", "max_request_retries", "max_dropped_ratio")},
        request_timeout=args.rollout_request_timeout, max_request_retries=args.rollout_max_retries,
        max_dropped_ratio=args.dynamic_sampling_max_dropped_ratio)
    plugins = PluginSettings(**{k: a[k] for k in PluginSettings.__dataclass_fields__})
    return RolloutSettings(hf_checkpoint=args.hf_checkpoint, data=data, engines=engines, sampling=sampling,
                           plugins=plugins, seed=args.seed)
