"""Command-line flags of the rollout manager (slime's names) and their validation.

``add_arguments`` adds the flags this part owns to a parser (the launcher composes every part's
flags into one parser); the settings dataclasses' fields declare them (:mod:`flags`), and check
their own values as they are built. ``settings_from_args`` builds ``RolloutSettings`` from the
parsed flags, checking what no one dataclass can (the SGLang pass-through, ``--rm-type``'s rules);
``ValueError`` names the flags.

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
from pathlib import Path

from flags import add_flags, flag_fields, flag_name, flag_of, from_args
from plugins.rewards import check_rm_type
from rollout_manager.settings import (DataSettings, EngineFleetSettings, PluginSettings, RolloutSettings,
                                      SamplingSettings)

_PARTS = (RolloutSettings, DataSettings, EngineFleetSettings, SamplingSettings, PluginSettings)
# Flags of ours that start with --sglang- (everything else with that prefix is passed through).
_OWN_SGLANG_FLAGS = tuple(flag_name(f) for cls in _PARTS for f, _ in flag_fields(cls)
                          if flag_name(f).startswith("--sglang-"))
_ENGINE_URLS, _ROUTER_IP, _ROUTER_PORT, _PER_ENGINE = (
    flag_of(EngineFleetSettings, f) for f in ("engine_urls", "sglang_router_ip", "sglang_router_port",
                                              "rollout_num_gpus_per_engine"))
# SGLang server flags the fleet sets for each engine it starts (engines.engine_command): passed
# through they would silently replace ours (argparse keeps the last value). Value: what to do instead.
_OWN_SERVERS = f"start the servers yourself and give {_ENGINE_URLS}"
_RESERVED_SERVER_FLAGS = {
    "--model-path": f"use {flag_of(RolloutSettings, 'hf_checkpoint')}",
    "--model": f"use {flag_of(RolloutSettings, 'hf_checkpoint')}",
    "--tp-size": f"use {_PER_ENGINE}", "--tensor-parallel-size": f"use {_PER_ENGINE}",
    "--port": f"each engine gets a free port (for fixed ports, {_OWN_SERVERS})",
    "--host": f"use {flag_of(EngineFleetSettings, 'rollout_engine_placement')} (for fixed hosts, {_OWN_SERVERS})",
    "--nccl-port": f"each engine gets distinct free ports (to choose them, {_OWN_SERVERS})",
    "--dist-init-addr": f"each engine gets distinct free ports (to choose them, {_OWN_SERVERS})",
    "--nccl-init-addr": f"each engine gets distinct free ports (to choose them, {_OWN_SERVERS})",
}
# sglang-router flags that the router started here gets from Reservoir (router.Router.start; its
# port is ours: --sglang-router-port).
_RESERVED_ROUTER_FLAGS = {
    "--host": f"to use a router you run yourself, give {_ROUTER_IP} and {_ROUTER_PORT}",
    "--policy": f"use {flag_of(EngineFleetSettings, 'router_policy')}", "--worker-urls": f"use {_ENGINE_URLS}",
    "--control-plane-api-keys": "it holds a key of its own for /workers, which only Reservoir needs",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the rollout manager's flags (and the shared ones it owns) to ``parser``: the settings
    dataclasses' fields declare them."""
    for cls in _PARTS:
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


def settings_from_args(args: argparse.Namespace, sglang_args: list[str] | None = None) -> RolloutSettings:
    """Build the settings from the rollout flags in ``args`` (each settings class checks its own
    fields) and check what they cannot: ``ValueError`` names the flags."""
    data = from_args(DataSettings, args)
    # Plugins read args.rollout_max_prompt_len, derived from --rollout-max-context-len when not given:
    # slime's validate_args sets it on the namespace at start-up, so its plugins expect it there.
    args.rollout_max_prompt_len = data.rollout_max_prompt_len
    server_args, router_args = split_router_args(list(sglang_args or []))
    api_key, admin_api_key = sglang_api_keys(server_args)
    extra_args = args.engine_extra_args
    if args.rollout_engine == "embedded":
        api_key, admin_api_key, extra_args = embedded_engine_keys(extra_args)
    engines = from_args(EngineFleetSettings, args, sglang_args=server_args, router_args=router_args, api_key=api_key,
                        admin_api_key=admin_api_key, engine_extra_args=extra_args)
    _check_passthrough(engines)
    sampling = from_args(SamplingSettings, args)
    plugins = from_args(PluginSettings, args)
    if not plugins.custom_rm_path:  # with one, --rm-type is only what plugins read (slime's async_rm)
        check_rm_type(plugins.rm_type, plugins.reward_key)
    return from_args(RolloutSettings, args, data=data, engines=engines, sampling=sampling, plugins=plugins)


def check_input_files(settings: RolloutSettings, building: str | None = None) -> None:
    """The files the rollout side reads as it starts, checked before anything starts (Ray, the
    engines), so that a typo costs no start-up and leaves nothing behind: the model at
    ``--hf-checkpoint``, ``--prompt-data`` (unless ``--data-source-path`` gives the prompts) and
    ``--eval-prompt-data``. ``building``: a checkpoint directory the launcher is about to build (the
    toy model); what lies under it is not checked yet. ``ValueError`` names the flag."""
    def missing(path: str) -> bool:
        return not (building and Path(path).resolve().is_relative_to(Path(building).resolve())) \
            and not Path(path).is_file()

    hf = flag_of(RolloutSettings, "hf_checkpoint")
    if not settings.hf_checkpoint:
        raise ValueError(f"{hf} is required (the model the engines serve; its tokenizer encodes the prompts)")
    if missing(str(Path(settings.hf_checkpoint, "config.json"))):
        raise ValueError(f"{hf} {settings.hf_checkpoint}: no HF checkpoint there (config.json missing)")
    prompts = flag_of(DataSettings, "prompt_data")
    if not settings.plugins.data_source_path:
        if not settings.data.prompt_data:
            raise ValueError(f"{prompts} is required (or {flag_of(PluginSettings, 'data_source_path')})")
        if missing(settings.data.prompt_data):
            raise ValueError(f"{prompts} {settings.data.prompt_data}: no such file")
    if settings.sampling.eval_prompt_data and missing(settings.sampling.eval_prompt_data):
        raise ValueError(f"{flag_of(SamplingSettings, 'eval_prompt_data')} {settings.sampling.eval_prompt_data}: "
                         "no such file")


def _check_passthrough(engines: EngineFleetSettings) -> None:
    """Refuse a ``--sglang-*`` / ``--sglang-router-*`` pass-through that would not reach its target."""
    _check_reserved(engines.sglang_args, engines.router_args)
    engine = flag_of(EngineFleetSettings, "rollout_engine")
    if engines.sglang_args and engines.rollout_engine != "sglang":
        raise ValueError(f"--sglang-* flags {engines.sglang_args} need {engine} sglang")
    if engines.router_args and engines.sglang_router_ip is not None:
        raise ValueError(f"--sglang-router-* flags {engines.router_args} configure the router started here; with "
                         f"{_ROUTER_IP} a running router is used (configure that one)")
