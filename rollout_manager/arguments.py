"""Command-line flags of the rollout manager (slime's names) and their validation.

``add_arguments`` adds the flags this part owns to a parser (the launcher composes every part's
flags into one parser); the settings dataclasses' fields declare them (:mod:`flags`).
``settings_from_args`` validates flag combinations (``ValueError`` naming the flags) and builds
``RolloutSettings``.

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

from flags import add_flags, from_args
from rollout_manager.settings import (REQUEST_GRANULARITIES, DataSettings, EngineFleetSettings, PluginSettings,
                                      RolloutSettings, SamplingSettings)

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
    """Add the rollout manager's flags (and the shared ones it owns) to ``parser``: the settings
    dataclasses' fields declare them."""
    for cls in (RolloutSettings, DataSettings, EngineFleetSettings, SamplingSettings, PluginSettings):
        add_flags(parser, cls)


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
    data = from_args(DataSettings, args)
    api_key, admin_api_key = sglang_api_keys(server_args)
    extra_args = args.engine_extra_args
    if args.rollout_engine == "embedded":
        api_key, admin_api_key, extra_args = embedded_engine_keys(extra_args)
    engines = from_args(EngineFleetSettings, args, sglang_args=server_args, router_args=router_args, api_key=api_key,
                        admin_api_key=admin_api_key, engine_extra_args=extra_args)
    sampling = from_args(SamplingSettings, args)
    plugins = from_args(PluginSettings, args)
    return from_args(RolloutSettings, args, data=data, engines=engines, sampling=sampling, plugins=plugins)
