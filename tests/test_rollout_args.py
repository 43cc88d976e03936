"""Flags -> settings, validation messages naming the flags, SGLang pass-through, plugin errors."""

from __future__ import annotations

import argparse

import pytest
from _fixtures_rollout import make_args

from flags import SettingError
from rollout_manager.arguments import add_arguments, split_sglang_args
from rollout_manager.manager import RolloutManager
from rollout_manager.settings import (DataSettings, EngineFleetSettings, PluginSettings, RolloutSettings,
                                      SamplingSettings)


def test_defaults_come_from_the_dataclasses():
    args, s = make_args([])
    assert s == RolloutSettings()  # every default in one place: the parser adds none of its own


def test_flags_reach_settings():
    _, s = make_args(["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--n-samples-per-prompt", "4",
                      "--rollout-batch-size", "8", "--over-sampling-batch-size", "16", "--partial-rollout",
                      "--mask-offpolicy-in-partial-rollout", "--rollout-num-engines", "2", "--engine-urls",
                      "127.0.0.1:1", "127.0.0.1:2", "--rm-type", "toy_arithmetic", "--rollout-max-retries", "2"])
    assert s.hf_checkpoint == "m" and s.data.prompt_data == "p.jsonl"
    assert (s.sampling.n_samples_per_prompt, s.sampling.rollout_batch_size, s.sampling.over_sampling_batch_size) == \
        (4, 8, 16)
    assert s.sampling.partial_rollout and s.sampling.mask_offpolicy_in_partial_rollout
    assert s.sampling.max_request_retries == 2
    assert s.engines.engine_urls == ["127.0.0.1:1", "127.0.0.1:2"] and s.engines.rollout_num_engines == 2
    assert s.plugins.rm_type == "toy_arithmetic"


@pytest.mark.parametrize("argv,msg", [
    (["--rollout-batch-size", "0"], "--rollout-batch-size must be > 0"),
    (["--rollout-batch-size", "8", "--over-sampling-batch-size", "4"], "--over-sampling-batch-size"),
    (["--mask-offpolicy-in-partial-rollout"], "needs --partial-rollout"),
    (["--sglang-router-ip", "127.0.0.1"], "--sglang-router-ip and --sglang-router-port"),
    (["--rm-url", "http://x", "--custom-rm-path", "a.b"], "--rm-url and --custom-rm-path"),
    (["--group-rm"], "--group-rm needs --custom-rm-path"),
    (["--rm-type", "nope"], "--rm-type 'nope'"),
    (["--rm-type", "ifbench"], "--rm-type ifbench: not supported"),
    (["--rm-type", "dapo"], "add --reward-key score"),
    (["--rollout-engine", "sglang"], "--rollout-num-gpus"),
    (["--rollout-temperature", "-1"], "--rollout-temperature"),
    (["--rollout-top-p", "0"], "--rollout-top-p"),
    (["--sglang-mem-fraction-static", "0.5"], "--rollout-engine sglang"),
    (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2", "--rollout-engine", "sglang"], "multiple"),
])
def test_bad_flag_combinations_name_the_flags(argv, msg):
    with pytest.raises(ValueError, match=msg):
        make_args(argv)


@pytest.mark.parametrize("argv,msg", [
    # the flags that set fields of other names: --rollout-max-retries sets max_request_retries, ...
    (["--rollout-max-retries", "-1"], "--rollout-max-retries must be >= 0, got -1"),
    (["--rollout-request-timeout", "0"], "--rollout-request-timeout must be > 0, got 0.0"),
    (["--dynamic-sampling-max-dropped-ratio", "0"], "--dynamic-sampling-max-dropped-ratio must be > 0, got 0.0"),
    (["--rollout-top-p", "2"], "--rollout-top-p must be in (0, 1], got 2.0"),
    (["--rollout-max-context-len", "64", "--rollout-max-prompt-len", "64"],
     "--rollout-max-prompt-len (64) must be below --rollout-max-context-len (64)"),
    (["--sglang-router-port", "1"], "--sglang-router-ip and --sglang-router-port go together"),
    (["--rm-type", "remote"], "--rm-type remote needs --rm-url (the reward model's address)"),
    (["--rollout-engine-ray-resources", "rollout"],
     "--rollout-engine-ray-resources 'rollout': expected NAME=AMOUNT, AMOUNT > 0 (e.g. rollout=1)"),
    (["--rollout-engine-ray-resources", "rollout=1", "=2"],
     "--rollout-engine-ray-resources '=2': expected NAME=AMOUNT, AMOUNT > 0 (e.g. rollout=1)"),
])
def test_settings_errors_from_flags_name_the_declared_flag(argv, msg):
    """The settings classes' own checks, reached through the flags: the whole text, flags named."""
    with pytest.raises(ValueError) as e:
        make_args(argv)
    assert str(e.value) == msg and not isinstance(e.value, SettingError)


@pytest.mark.parametrize("build,msg", [
    (lambda: SamplingSettings(rollout_top_p=2.0), "rollout_top_p must be in (0, 1], got 2.0"),
    (lambda: SamplingSettings(max_request_retries=-1), "max_request_retries must be >= 0, got -1"),
    (lambda: EngineFleetSettings(rollout_engine="sglang"),
     "rollout_engine sglang needs rollout_num_gpus > 0 (SGLang runs on GPUs)"),
    (lambda: PluginSettings(group_rm=True), "group_rm needs custom_rm_path (a batched reward function)"),
    (lambda: DataSettings(rollout_max_context_len=1), "rollout_max_context_len must be >= 2, got 1"),
])
def test_settings_built_in_code_name_the_field(build, msg):
    with pytest.raises(SettingError) as e:
        build()
    assert str(e.value) == msg


def test_engine_ray_resources_parse_to_a_dict():
    assert EngineFleetSettings(rollout_engine_ray_resources=["rollout=1", " gpu_node = 0.5"]).ray_resources() == \
        {"rollout": 1.0, "gpu_node": 0.5}
    with pytest.raises(SettingError, match="rollout_engine_ray_resources 'a=-1'"):
        EngineFleetSettings(rollout_engine_ray_resources=["a=-1"])


def test_prompt_budget_defaults_to_the_context_budget_minus_one():
    """slime's default, in the settings and in the namespace plugins read (slime sets it there)."""
    assert DataSettings(rollout_max_context_len=64).rollout_max_prompt_len == 63
    args, s = make_args(["--rollout-max-context-len", "64"])
    assert args.rollout_max_prompt_len == s.data.rollout_max_prompt_len == 63
    args, s = make_args(["--rollout-max-context-len", "64", "--rollout-max-prompt-len", "10"])
    assert args.rollout_max_prompt_len == s.data.rollout_max_prompt_len == 10


def test_sglang_passthrough():
    ours, theirs = split_sglang_args(["--rollout-batch-size", "4", "--sglang-mem-fraction-static", "0.7",
                                      "--sglang-enable-torch-compile", "--sglang-router-port", "9",
                                      "--sglang-server-concurrency=8", "--sglang-log-level=warn"])
    assert ours == ["--rollout-batch-size", "4", "--sglang-router-port", "9", "--sglang-server-concurrency=8"]
    assert theirs == ["--mem-fraction-static", "0.7", "--enable-torch-compile", "--log-level=warn"]
    _, s = make_args(["--rollout-engine", "sglang", "--rollout-num-gpus", "2", "--sglang-mem-fraction-static", "0.7"])
    assert s.engines.sglang_args == ["--mem-fraction-static", "0.7"]


def test_flags_compose_into_one_parser_without_clashes():
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(argparse.ArgumentError):
        add_arguments(p)  # the launcher composes each part once; a second copy clashes loudly


@pytest.mark.parametrize("flag,value,msg", [
    ("--rollout-function-path", "no_such_mod_xyz.fn", "cannot import module"),
    ("--custom-generate-function-path", "os.path.join", "async"),
    ("--custom-generate-function-path", "asyncio.sleep", "cannot be called as"),
    ("--dynamic-sampling-filter-path", "os.getcwd", "cannot be called as"),
    ("--custom-rm-path", "os.path.nope", "has no attribute"),
])
def test_plugin_errors_at_start_up_name_flag_and_path(flag, value, msg):
    args, s = make_args([flag, value, "--hf-checkpoint", "unused", "--prompt-data", "unused.jsonl"])
    with pytest.raises(ValueError, match=msg) as e:
        RolloutManager(s, args)
    assert flag in str(e.value) and value in str(e.value)


@pytest.mark.parametrize("module", ["embedded_engine.settings", "embedded_engine.instant"])
def test_engine_parsers_refuse_abbreviated_flags(module, capsys):
    """``--hos`` is a prefix of ``--host``: an error naming it, never taken for that flag."""
    import importlib

    ap = importlib.import_module(module).build_parser()
    with pytest.raises(SystemExit):
        ap.parse_args(["--port", "1", "--model-path", "m", "--hos", "0.0.0.0"])
    assert "unrecognized arguments: --hos 0.0.0.0" in capsys.readouterr().err
    assert ap.parse_args(["--port", "1", "--model-path", "m", "--host", "0.0.0.0"]).host == "0.0.0.0"
