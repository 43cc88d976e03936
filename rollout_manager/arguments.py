"""Command-line flags of the rollout manager (slime's names) and their validation.

``add_arguments`` adds the flags this part owns to a parser (the launcher composes every part's
flags into one parser); defaults come from the settings dataclasses. ``settings_from_args``
validates flag combinations (``ValueError`` naming the flags) and builds ``RolloutSettings``.

SGLang server flags pass through as ``--sglang-<flag> [values]`` (e.g. ``--sglang-mem-fraction-static
0.8``, ``--sglang-cuda-graph-bs-decode 1 2 4 8``): ``split_sglang_args`` pulls them out of ``argv``
before parsing, because their set depends on the installed SGLang version. ``--sglang-router-<flag>``
(slime's names) go to the sglang-router started here instead. Flags Reservoir sets for each engine
itself (model, host, port, TP size, rendezvous ports) are refused, naming the flag to use instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import shlex
from typing import Any

from rollout_manager.settings import (REQUEST_GRANULARITIES, ROUTER_POLICIES, DataSettings, EngineFleetSettings, PluginSettings,
                                      RolloutSettings, SamplingSettings)

D, E, S, P = DataSettings, EngineFleetSettings, SamplingSettings, PluginSettings

# Flags of ours that start with --sglang- (everything else with that prefix is passed through).
_OWN_SGLANG_FLAGS = ("--sglang-router-ip", "--sglang-router-port", "--sglang-server-concurrency")
# SGLang server flags the fleet sets for each engine it starts (engines.engine_command): passed
# through they would silently replace ours (argparse keeps the last value). Value: what to do instead.
_OWN_SERVERS = "start the servers yourself and give --engine-urls"
_RESERVED_SERVER_FLAGS = {
    "--model-path": "use --hf-checkpoint", "--model": "use --hf-checkpoint",
    "--tp-size": "use --rollout-num-gpus-per-engine", "--tensor-parallel-size": "use --rollout-num-gpus-per-engine",
    "--port": f"each engine gets a free port (for fixed ports, {_OWN_SERVERS})",
    "--host": f"use --rollout-engine-placement (for fixed hosts, {_OWN_SERVERS})",
    "--nccl-port": f"each engine gets distinct free ports (to choose them, {_OWN_SERVERS})",
    "--dist-init-addr": f"each engine gets distinct free ports (to choose them, {_OWN_SERVERS})",
    "--nccl-init-addr": f"each engine gets distinct free ports (to choose them, {_OWN_SERVERS})",
}
# sglang-router flags that the router started here gets from Reservoir (router.Router.start; its
# port is ours: --sglang-router-port).
_RESERVED_ROUTER_FLAGS = {
    "--host": "to use a router you run yourself, give --sglang-router-ip and --sglang-router-port",
    "--policy": "use --router-policy", "--worker-urls": "use --engine-urls",
    "--control-plane-api-keys": "it holds a key of its own for /workers, which only Reservoir needs",
}


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
    g.add_argument("--rollout-max-context-len", type=int, default=D.rollout_max_context_len,
                   help="slime's prompt + response budget: plugins read it (args.rollout_max_context_len), and "
                        "--rollout-max-prompt-len defaults to it minus one")
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
    g.add_argument("--eval-max-context-len", type=int, default=S.eval_max_context_len,
                   help="slime's context budget for evaluation, read by plugins (default: --rollout-max-context-len)")

    g = parser.add_argument_group("rollout: plugins and rewards")
    g.add_argument("--rollout-function-path", default=P.rollout_function_path)
    g.add_argument("--custom-generate-function-path", default=P.custom_generate_function_path)
    g.add_argument("--rm-type", default=P.rm_type, help="built-in reward: math, exact_match, toy_arithmetic, remote, "
                   "and slime's deepscaler, dapo (with --reward-key score), f1, gpqa, random, remote_rm and the "
                   "boxed_<type> prefix (plugins/rewards.py); ignored with --custom-rm-path, and with --rm-url "
                   "unless it is remote or remote_rm")
    g.add_argument("--rm-url", default=P.rm_url, help="remote reward model (POST {prompt, response, label})")
    g.add_argument("--custom-rm-path", default=P.custom_rm_path)
    g.add_argument("--group-rm", action="store_true", default=P.group_rm)
    g.add_argument("--reward-key", default=P.reward_key)
    g.add_argument("--dynamic-sampling-filter-path", default=P.dynamic_sampling_filter_path,
                   help="filter(args, group) -> bool or slime's DynamicFilterOutput (keep, reason, "
                        "keep_when_insufficient): whether a finished group is kept")

    g.add_argument("--reward-timeout", type=float, default=P.reward_timeout,
                   help="seconds one reward call may take (a sample's, or a group's with --group-rm); past it the "
                        "sample(s) fail with 'reward: timeout', counted. Plain (non-async) reward functions run in "
                        "a thread, so a blocking one does not stall the rollout")
    g.add_argument("--custom-generate-timeout", type=float, default=P.custom_generate_timeout,
                   help="seconds one --custom-generate-function-path call may take; past it the sample fails "
                        "with 'generate: timeout', counted")
    g.add_argument("--filter-timeout", type=float, default=P.filter_timeout,
                   help="seconds one call of --dynamic-sampling-filter-path, --rollout-sample-filter-path or "
                        "--rollout-all-samples-process-path may take (they run in a thread); past it the group is "
                        "dropped (or the hook skipped), counted as 'filter: timeout'")

    g = parser.add_argument_group("rollout: slime's other hooks (docs/slime.md)")
    g.add_argument("--data-source-path", default=P.data_source_path,
                   help="a data source class, built as cls(args), with get_samples(n) / add_samples(groups) (e.g. a "
                        "subclass of slime.rollout.data_source.RolloutDataSourceWithBuffer); default: Reservoir's")
    g.add_argument("--eval-function-path", default=P.eval_function_path,
                   help="the rollout function for evaluation (default: --rollout-function-path)")
    g.add_argument("--rollout-sample-filter-path", default=P.rollout_sample_filter_path,
                   help="fn(args, groups) called on each training step's kept groups (default rollout); samples it "
                        "marks remove_sample=True stay in the batch with a zero loss mask")
    g.add_argument("--rollout-all-samples-process-path", default=P.rollout_all_samples_process_path,
                   help="fn(args, groups, get_samples) called on every finished group of a training step, kept "
                        "or filtered out (default rollout)")
    g.add_argument("--rollout-sample-hook-path", action="append", default=[],
                   help="hook(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None on each generated "
                        "sample before its reward, sync or async; repeat the flag for several (run in order)")
    g.add_argument("--custom-rollout-log-function-path", default=P.custom_rollout_log_function_path,
                   help="fn(rollout_id, args, samples, extra_metrics, seconds) -> bool after each rollout step; "
                        "True: skip Reservoir's rollout metrics for that step")
    g.add_argument("--custom-eval-rollout-log-function-path", default=P.custom_eval_rollout_log_function_path,
                   help="fn(rollout_id, args, data, extra_metrics) -> bool after each evaluation; True: skip "
                        "Reservoir's eval metrics")


def split_sglang_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into (ours, theirs): ``--sglang-X [values]`` becomes ``--X [values]``, with every
    value up to the next flag (SGLang has multi-value flags such as ``--cuda-graph-bs-decode 1 2 4 8``).
    ``--sglang-router-X`` becomes ``--router-X`` (``settings_from_args`` sends those to the router)."""
    ours: list[str] = []
    theirs: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if not tok.startswith("--sglang-") or tok.split("=", 1)[0] in _OWN_SGLANG_FLAGS:
            ours.append(tok)
            continue
        theirs.append("--" + tok[len("--sglang-"):])
        if "=" not in tok:
            while i < len(argv) and not _is_flag(argv[i]):
                theirs.append(argv[i])
                i += 1
    return ours, theirs


def _is_flag(tok: str) -> bool:
    """Whether ``tok`` starts a new flag (a negative number such as ``-1`` is a value)."""
    if not tok.startswith("-") or tok == "-":
        return False
    try:
        float(tok)
    except ValueError:
        return True
    return False


def _flag_groups(tokens: list[str]) -> list[list[str]]:
    """``["--a", "1", "2", "--b"]`` -> ``[["--a", "1", "2"], ["--b"]]`` (each flag with its values)."""
    groups: list[list[str]] = []
    for tok in tokens:
        if _is_flag(tok) or not groups:
            groups.append([tok])
        else:
            groups[-1].append(tok)
    return groups


def _flag_name(group: list[str]) -> str:
    return group[0].split("=", 1)[0]


def _flag_value(groups: list[list[str]], name: str) -> str | None:
    """The value of the last ``name VALUE`` / ``name=VALUE`` in ``groups`` (None if absent)."""
    value = None
    for g in groups:
        if _flag_name(g) == name:
            value = g[0].split("=", 1)[1] if "=" in g[0] else (g[1] if len(g) > 1 else None)
    return value


def split_router_args(sglang_args: list[str]) -> tuple[list[str], list[str]]:
    """Split ``split_sglang_args``' output into (SGLang server tokens, sglang-router tokens): slime's
    ``--sglang-router-X`` flags configure the router (``--X``); ``sglang.launch_server`` exits on them."""
    server: list[str] = []
    router: list[str] = []
    for g in _flag_groups(sglang_args):
        if g[0].startswith("--router-"):
            router += ["--" + g[0][len("--router-"):], *g[1:]]
        else:
            server += g
    return server, router


def sglang_api_keys(sglang_args: list[str]) -> tuple[str | None, str | None]:
    """The SGLang servers' ``(--api-key, --admin-api-key)`` in the pass-through (None: not given)."""
    groups = _flag_groups(split_router_args(sglang_args)[0])
    return _flag_value(groups, "--api-key"), _flag_value(groups, "--admin-api-key")


def embedded_engine_keys(engine_extra_args: str) -> tuple[str | None, str | None, str]:
    """The embedded engines' ``(api_key, admin_api_key, engine_extra_args without them)``: keys
    given in ``--engine-extra-args`` reach the engines through their environment instead (a
    command line is readable by every local user)."""
    groups = _flag_groups(shlex.split(engine_extra_args or ""))
    api_key, admin_api_key = _flag_value(groups, "--api-key"), _flag_value(groups, "--admin-api-key")
    rest = [tok for g in groups if _flag_name(g) not in ("--api-key", "--admin-api-key") for tok in g]
    return api_key, admin_api_key, shlex.join(rest)


def with_engine_admin_key(settings: RolloutSettings) -> RolloutSettings:
    """Embedded engines started here get a random admin key when none was given, so that their
    control routes (pause, weight updates, memory, abort) answer this run's clients only
    (docs/security.md); the run's clients send it. Engines given by ``--engine-urls`` keep what
    they were started with; SGLang servers take ``--sglang-admin-api-key``. Called by the entry
    points (the launcher, ``python -m rollout_manager``) once, after the settings are built."""
    e = settings.engines
    if e.rollout_engine != "embedded" or e.engine_urls or e.admin_api_key:
        return settings
    return dataclasses.replace(settings, engines=dataclasses.replace(e, admin_api_key=secrets.token_urlsafe(24)))


def _check_reserved(server: list[str], router: list[str]) -> None:
    for prefix, tokens, reserved in (("--sglang-", server, _RESERVED_SERVER_FLAGS),
                                     ("--sglang-router-", router, _RESERVED_ROUTER_FLAGS)):
        for g in _flag_groups(tokens):
            instead = reserved.get(_flag_name(g))
            if instead is not None:
                flag = prefix + _flag_name(g)[2:]
                raise ValueError(f"{flag}: Reservoir sets this itself for the engines and the router it "
                                 f"starts; {instead}")


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
              "eval_max_context_len",
              "health_check_interval", "health_check_timeout", "dynamic_sampling_max_dropped_ratio",
              "reward_timeout", "custom_generate_timeout", "filter_timeout")
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
    from plugins.rewards import REMOTE_RMS, check_rm_type
    if not args.custom_rm_path:  # with one, --rm-type is only what plugins read (slime's async_rm)
        check_rm_type(args.rm_type, args.reward_key)
    if args.rm_type in REMOTE_RMS and not args.rm_url and not args.custom_rm_path:
        raise ValueError(f"--rm-type {args.rm_type} needs --rm-url (the reward model's address)")
    if args.rollout_max_context_len is not None:
        if args.rollout_max_context_len < 2:
            raise ValueError(f"--rollout-max-context-len must be >= 2, got {args.rollout_max_context_len}")
        if args.rollout_max_prompt_len is None:  # slime: at least one token left to generate
            args.rollout_max_prompt_len = args.rollout_max_context_len - 1
        elif args.rollout_max_prompt_len > args.rollout_max_context_len - 1:
            raise ValueError(f"--rollout-max-prompt-len ({args.rollout_max_prompt_len}) must be below "
                             f"--rollout-max-context-len ({args.rollout_max_context_len})")
    if args.rollout_engine == "sglang" and args.rollout_num_gpus == 0 and not args.engine_urls:
        raise ValueError("--rollout-engine sglang needs --rollout-num-gpus > 0 (SGLang runs on GPUs)")
    if args.rollout_num_gpus and args.rollout_num_gpus % args.rollout_num_gpus_per_engine:
        raise ValueError(f"--rollout-num-gpus ({args.rollout_num_gpus}) must be a multiple of "
                         f"--rollout-num-gpus-per-engine ({args.rollout_num_gpus_per_engine})")
    server_args, router_args = split_router_args(list(sglang_args or []))
    _check_reserved(server_args, router_args)
    if server_args and args.rollout_engine != "sglang":
        raise ValueError(f"--sglang-* flags {server_args} need --rollout-engine sglang")
    if router_args and args.sglang_router_ip is not None:
        raise ValueError(f"--sglang-router-* flags {router_args} configure the router started here; with "
                         "--sglang-router-ip a running router is used (configure that one)")
    a: dict[str, Any] = vars(args)
    data = DataSettings(**{k: a[k] for k in DataSettings.__dataclass_fields__})
    api_key, admin_api_key = sglang_api_keys(server_args)
    extra_args = args.engine_extra_args
    if args.rollout_engine == "embedded":
        api_key, admin_api_key, extra_args = embedded_engine_keys(extra_args)
    passed = ("sglang_args", "router_args", "api_key", "admin_api_key", "weight_update_dirs", "weight_update_masters",
              "engine_extra_args")
    engines = EngineFleetSettings(
        **{k: a[k] for k in EngineFleetSettings.__dataclass_fields__ if k not in passed},
        sglang_args=server_args, router_args=router_args, api_key=api_key, admin_api_key=admin_api_key,
        engine_extra_args=extra_args)
    sampling = SamplingSettings(
        **{k: a[k] for k in SamplingSettings.__dataclass_fields__
           if k not in ("request_timeout", "max_request_retries", "max_dropped_ratio")},
        request_timeout=args.rollout_request_timeout, max_request_retries=args.rollout_max_retries,
        max_dropped_ratio=args.dynamic_sampling_max_dropped_ratio)
    plugins = PluginSettings(**{k: a[k] for k in PluginSettings.__dataclass_fields__})
    return RolloutSettings(hf_checkpoint=args.hf_checkpoint, data=data, engines=engines, sampling=sampling,
                           plugins=plugins, seed=args.seed)
