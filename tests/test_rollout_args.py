"""Flags -> settings, validation messages naming the flags, SGLang pass-through, plugin errors."""

from __future__ import annotations

import argparse

import pytest
from _fixtures_rollout import make_args

from rollout_manager.arguments import add_arguments, split_sglang_args
from rollout_manager.manager import RolloutManager
from rollout_manager.settings import RolloutSettings


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
