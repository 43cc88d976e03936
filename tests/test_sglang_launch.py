"""The SGLang launch commands the engine fleet builds, read by SGLang's own launch-argument parser
(``sglang.srt.server_args.prepare_server_args``, what ``python -m sglang.launch_server`` runs):
every command parses, and the parsed ServerArgs carry our model, host, port, TP size, distinct
rendezvous ports and the ``--sglang-*`` pass-through values; the engines' environment turns off
SGLang's generating ``/health`` as SGLang's own ``envs`` reads it; the flags Reservoir sets itself
are refused under every name SGLang's parser knows them by.

SGLang is imported once for the module (its import takes seconds); nothing is started.
"""

from __future__ import annotations

import os
import sys

import pytest
from _fixtures_rollout import make_args
from sglang_oracle import import_sglang

from rollout_manager.engines import EngineFleet, child_environ

# Typical pass-through: a value, several values, a bare switch, a key; then slime's router flag
# and one of ours, which must not be swallowed as values.
PASS_THROUGH = ["--sglang-mem-fraction-static", "0.7", "--sglang-cuda-graph-bs-decode", "1", "2", "4", "8",
                "--sglang-enable-metrics", "--sglang-api-key", "k1", "--sglang-router-request-timeout-secs", "14400",
                "--rollout-batch-size", "4"]


@pytest.fixture(scope="module")
def sglang():
    try:
        return import_sglang()
    except ImportError:
        pytest.skip("SGLang is not installed")


def _plan(argv: list[str], tmp_path) -> tuple[list, object, object]:
    """The engines the fleet would start for ``argv`` (local placement: Ray cannot place GPUs here)."""
    args, settings = make_args(["--rollout-engine", "sglang", "--rollout-engine-placement", "local", *argv])
    return EngineFleet(settings, router=None, log_dir=tmp_path).plan(), settings, args


@pytest.mark.parametrize("hub_id", [False, True], ids=["local-dir", "hub-id"])
def test_every_engine_command_parses_with_sglangs_own_parser(sglang, toy_model_dir, tmp_path, hub_id):
    ckpt = "Qwen/Qwen3-4B" if hub_id else os.path.relpath(toy_model_dir)
    engines, settings, args = _plan(["--hf-checkpoint", ckpt, "--rollout-num-gpus", "4",
                                     "--rollout-num-gpus-per-engine", "2", *PASS_THROUGH], tmp_path)
    assert args.rollout_batch_size == 4  # our flag after the pass-through stayed ours
    assert len(engines) == 2
    reserved: list[set[int]] = []
    for eng in engines:
        assert eng.cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
        sa = sglang.server_args.prepare_server_args(eng.cmd[3:])  # exits (SystemExit 2) on a flag it does not know
        # a hub id stays a hub id (not a path under the cwd); a directory becomes absolute
        assert sa.model_path == (ckpt if hub_id else str(toy_model_dir))
        assert (sa.host, f"http://{sa.host}:{sa.port}") == ("127.0.0.1", eng.url)
        assert sa.tp_size == 2
        host, dist_port = sa.dist_init_addr.rsplit(":", 1)
        assert host == "127.0.0.1" and sa.nccl_port is not None
        # the pass-through, with every value of the multi-value flag
        assert sa.mem_fraction_static == 0.7
        assert sa.cuda_graph_bs_decode == [1, 2, 4, 8]
        assert sa.enable_metrics is True
        assert sa.api_key == "k1" == settings.engines.api_key
        reserved.append({sa.port, sa.nccl_port, int(eng.env["SGLANG_GRPC_PORT"]),
                         *range(int(dist_port), int(dist_port) + 30)})
        assert len(reserved[-1]) == 33  # an engine's own ports are distinct too
    assert not reserved[0] & reserved[1]  # two engines on one node never share a port
    assert not any(t.startswith("--router") for eng in engines for t in eng.cmd)
    assert settings.engines.router_args == ["--request-timeout-secs", "14400"]  # to the router instead


def test_engine_environment_turns_off_the_generating_health_check(sglang, toy_model_dir, tmp_path, monkeypatch):
    from sglang.srt.environ import envs

    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true")  # even if the launcher's env says so
    [eng], _, _ = _plan(["--hf-checkpoint", str(toy_model_dir), "--rollout-num-gpus", "1"], tmp_path)
    for k, v in child_environ(eng.env).items():  # the engine process's whole environment
        monkeypatch.setenv(k, v)
    assert envs.SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION.get() is False  # SGLang's /health answers without generating


# SGLang's fields the fleet sets for every engine, and the Reservoir flag each message names
OWN_FIELDS = {"model_path": "--hf-checkpoint", "tp_size": "--rollout-num-gpus-per-engine", "port": "--engine-urls",
              "host": "--engine-urls", "nccl_port": "--engine-urls", "dist_init_addr": "--engine-urls"}


def test_flags_reservoir_sets_are_refused_under_every_sglang_name(sglang):
    import argparse

    parser = argparse.ArgumentParser()
    sglang.server_args.ServerArgs.add_cli_args(parser)
    names = {o: a.dest for a in parser._actions for o in a.option_strings if a.dest in OWN_FIELDS}
    assert set(names.values()) == set(OWN_FIELDS)  # SGLang still has each of them
    assert {"--tensor-parallel-size", "--model", "--nccl-init-addr"} <= set(names)  # aliases included
    for name, dest in names.items():
        flag = "--sglang-" + name[2:]
        with pytest.raises(ValueError) as e:
            make_args(["--rollout-engine", "sglang", "--rollout-num-gpus", "2", flag, "1"])
        assert flag in str(e.value) and OWN_FIELDS[dest] in str(e.value), str(e.value)
