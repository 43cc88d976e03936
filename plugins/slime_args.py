"""The argparse namespace slime plugins see: Reservoir's flags plus slime's names for the rest.

slime plugins read ``args.<name>`` for many of slime's flags that Reservoir does not have (or has
under the same name with the same meaning). ``fill_slime_args`` adds the missing ones, each with
the value it means in slime for this run (never overwriting a flag Reservoir parsed):

- ``sglang_<flag>``: the SGLang server flags passed through as ``--sglang-<flag>`` (``--sglang-dp-size
  2`` -> ``args.sglang_dp_size == 2``; a flag without a value is True), else SGLang's defaults for
  the ones plugins read (``sglang_dp_size`` 1, ``sglang_tp_size`` the engine's GPUs...);
- run facts: ``rollout_global_dataset`` (True: the rollout draws from ``--prompt-data``),
  ``over_sampling_batch_size`` (the batch size when not given, as slime sets it),
  ``eval_function_path`` / ``eval_reward_key`` / ``eval_max_context_len`` (their slime fallbacks);
- features Reservoir does not have, at their off values (``use_rollout_routing_replay`` False,
  ``multimodal_keys`` None, ``ci_test`` False...).

The rollout manager calls it once, before loading the plugins; ``sglang_router_ip/port`` and
``rollout_num_engines`` are set when the engines are up. ``fill_trainer_args`` is the trainer side's
view (``train_backend/hooks.py``), ``custom_config`` the ``--custom-config-path`` YAML both sides read.

It lives in ``plugins/`` (and imports nothing of ours) because the rollout manager and the trainer
both call it, and both sit above this package.
"""

from __future__ import annotations

import argparse
from typing import Any

# slime flag -> its value when the feature is off or absent (Reservoir has no flag for these)
_OFF: dict[str, Any] = {
    "ci_test": False,
    "use_rollout_routing_replay": False,
    "use_distributed_post": False,
    "use_fault_tolerance": False,
    "multimodal_keys": None,
    "apply_chat_template_kwargs": {},
    "tool_key": "tools",
    "rollout_sample_hook_path": [],
    "buffer_filter_path": None,
    "dump_details": None,
    "log_passrate": False,
    "log_reward_category": None,
    "eval_top_p": None,
    "eval_top_k": None,
    "eval_min_new_tokens": None,
    "load_debug_rollout_data": None,
    "save_debug_rollout_data": None,
    "debug_rollout_only": False,
    "debug_train_only": False,
    "save": None,
    "load": None,
    "context_parallel_size": 1,
    "advantage_estimator": "grpo",
    "sglang_dp_size": 1,
    "sglang_enable_deterministic_inference": False,
    "sglang_speculative_algorithm": None,
    "sglang_enable_dp_attention": False,
}
# SGLang's long aliases -> the names slime's args use
_SGLANG_ALIASES = {"data_parallel_size": "dp_size", "tensor_parallel_size": "tp_size",
                   "pipeline_parallel_size": "pp_size", "expert_parallel_size": "ep_size"}


def _value(tokens: list[str]) -> Any:
    if not tokens:
        return True
    vals = []
    for t in tokens:
        for cast in (int, float):
            try:
                vals.append(cast(t))
                break
            except ValueError:
                continue
        else:
            vals.append(t)
    return vals[0] if len(vals) == 1 else vals


def sglang_attrs(sglang_args: list[str]) -> dict[str, Any]:
    """``["--dp-size", "2", "--enable-x"]`` -> ``{"sglang_dp_size": 2, "sglang_enable_x": True}``."""
    out: dict[str, Any] = {}
    name, values = None, []
    for tok in [*sglang_args, "--"]:
        is_flag = tok.startswith("--")
        if is_flag and name is not None:
            out["sglang_" + _SGLANG_ALIASES.get(name, name)] = _value(values)
            name, values = None, []
        if is_flag and tok != "--":
            flag, eq, val = tok[2:].partition("=")
            name, values = flag.replace("-", "_"), ([val] if eq else [])
        elif not is_flag and name is not None:
            values.append(tok)
    return out


def fill_slime_args(args: argparse.Namespace, settings: Any) -> argparse.Namespace:
    """Add slime's attribute names to ``args`` (see the module doc); returns ``args``."""
    def put(name: str, value: Any) -> None:
        if not hasattr(args, name):
            setattr(args, name, value)

    for name, value in custom_config(args).items():
        setattr(args, name, value)
    put("max_tokens_per_gpu", getattr(args, "max_tokens_per_micro_batch", None))
    for name, value in sglang_attrs(list(settings.engines.sglang_args)).items():
        put(name, value)
    put("sglang_tp_size", settings.engines.rollout_num_gpus_per_engine)
    for name, value in _OFF.items():
        put(name, value.copy() if isinstance(value, (dict, list)) else value)
    put("rollout_global_dataset", True)
    if getattr(args, "over_sampling_batch_size", None) is None:  # slime's default, set the same way
        s = settings.sampling
        args.over_sampling_batch_size = s.over_sampling_batch_size or s.rollout_batch_size
    if getattr(args, "eval_function_path", None) is None:
        args.eval_function_path = settings.plugins.rollout_function_path
    put("eval_reward_key", settings.plugins.reward_key)
    if getattr(args, "eval_max_context_len", None) is None:
        args.eval_max_context_len = getattr(args, "rollout_max_context_len", None)
    put("rollout_max_context_len", None)
    put("rollout_num_engines", settings.engines.rollout_num_engines)
    return args


def custom_config(args: argparse.Namespace) -> dict[str, Any]:
    """``--custom-config-path FILE``: the YAML mapping slime sets on ``args`` for custom functions.

    slime overwrites any attribute with it; here a key that names a parsed flag must hold the value
    that flag has (slime's ``mis.yaml`` repeats ``use_tis: true`` beside its run script's
    ``--use-tis``); another value is refused, since the run's components were configured from the
    flags and plugins would see a value not in use. ``ValueError`` names the file and the key."""
    path = getattr(args, "custom_config_path", None)
    if not path:
        return {}
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--custom-config-path {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--custom-config-path {path}: expected a mapping of names to values")
    for key in data:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"--custom-config-path {path}: key {key!r} is not an attribute name")
        flag = key.replace("_", "-")
        if hasattr(args, key) and key != "custom_config_path" and getattr(args, key) != data[key]:
            raise ValueError(f"--custom-config-path {path}: key {key!r} = {data[key]!r} is the flag --{flag}, "
                             f"which is {getattr(args, key)!r} in this run; set flags on the command line or "
                             "in --config")
    return data


# slime's trainer-side names for what Reservoir has under other names or not at all
def fill_trainer_args(args: argparse.Namespace, settings: Any) -> argparse.Namespace:
    """``args`` for trainer-side plugins (``train_backend/hooks.py``): slime's names added, never
    overwriting a flag's value. ``settings``: the run's ``TrainSettings``."""
    def put(name: str, value: Any) -> None:
        if not hasattr(args, name):
            setattr(args, name, value)

    put("kl_loss_coef", settings.kl_coef)
    put("kl_coef", settings.reward_kl_coef)
    put("kl_loss_type", settings.kl_loss_type)
    put("calculate_per_token_loss", settings.loss_agg == "token_mean")
    put("tis_clip", settings.tis_cap)
    put("tis_clip_low", settings.tis_clip_low)
    put("use_rollout_logprobs", False)
    put("use_opsm", False)
    put("use_unbiased_kl", False)
    put("max_tokens_per_gpu", settings.max_tokens_per_micro_batch)
    put("advantage_estimator", settings.advantage_estimator)
    put("rollout_temperature", settings.rollout_temperature)
    put("loss_type", settings.loss_type)
    for name, value in _OFF.items():
        put(name, value.copy() if isinstance(value, (dict, list)) else value)
    return args
