"""Small pieces without sockets: engine command lines (SGLang pass-through), direct dispatch,
weight-version parsing, segment appending with off-policy masking."""

from __future__ import annotations

import asyncio

import pytest
from _fixtures_rollout import make_args

from buffer.sample import Sample
from rollout_manager.dispatch import Dispatcher
from sglang_protocol.client import EngineClient
from rollout_manager.engines import EnginePorts, engine_command
from rollout_manager.generate import append_segment, parse_weight_version, reset_sample


def test_sglang_command_line_and_gpus():
    _, s = make_args(["--hf-checkpoint", "/m", "--rollout-engine", "sglang", "--rollout-num-gpus", "4",
                      "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7",
                      "--sglang-enable-torch-compile"])
    cmd, env = engine_command(s, 1, EnginePorts(60001, nccl_port=20000, dist_init_port=20001, grpc_port=20065))
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--port") + 1] == "60001"
    assert cmd[cmd.index("--nccl-port") + 1] == "20000" and cmd[cmd.index("--dist-init-addr") + 1] == "127.0.0.1:20001"
    assert cmd[-3:] == ["--mem-fraction-static", "0.7", "--enable-torch-compile"]
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"  # engine 1 of 2-GPU engines
    assert env["SGLANG_GRPC_PORT"] == "20065"  # SGLang 0.5.15's own pick (port + 10000) would pass 65535


def test_embedded_command_line():
    _, s = make_args(["--hf-checkpoint", "/m", "--rollout-num-engines", "2",
                      "--engine-extra-args", "--max-running-requests 16"])
    cmd, env = engine_command(s, 0, EnginePorts(30002), host="10.0.0.5")
    assert cmd[1:3] == ["-m", "embedded_engine"] and cmd[-2:] == ["--max-running-requests", "16"]
    assert cmd[cmd.index("--host") + 1] == "10.0.0.5" and "CUDA_VISIBLE_DEVICES" not in env


def test_direct_dispatch_picks_least_loaded_live_engine():
    async def go():  # (sessions need a loop; no request is sent)
        live = ["http://a", "http://b", "http://c"]
        router = EngineClient("http://router")
        d = Dispatcher(router, lambda: live, direct=True, timeout=None)
        d.inflight = {"http://a": 2, "http://b": 0, "http://c": 1}
        assert d.pick(set())[0] == "http://b"
        assert d.pick({"http://b"})[0] == "http://c"  # b just failed this sample
        assert d.pick(set(live))[0] == "http://b"  # all failed: fall back to every live engine
        live.remove("http://b")  # deregistered by the health monitor
        assert d.pick(set())[0] == "http://c"
        live.clear()  # nothing live: the router answers (503) and the caller backs off
        assert d.pick(set())[0] == "http://router"
        await d.close()
        await router.close()
    asyncio.run(go())


def test_weight_versions_and_offpolicy_mask():
    assert parse_weight_version("default") == 0 and parse_weight_version("7") == 7
    with pytest.raises(RuntimeError, match="not an integer"):
        parse_weight_version("v1")
    s = Sample(tokens=[1, 2, 3], loss_mask=[], rollout_log_probs=[])

    def out(ids, version, finish="stop"):
        return {"text": "x" * len(ids), "output_ids": ids, "meta_info": {
            "weight_version": version, "finish_reason": {"type": finish},
            "output_token_logprobs": [[-0.1, t, None] for t in ids]}}
    assert append_segment(s, out([], "3", "abort"), mask_offpolicy=True) == 0
    assert s.weight_versions == []  # an empty aborted segment tags nothing
    append_segment(s, out([4, 5], "3", "abort"), mask_offpolicy=True)
    append_segment(s, out([6], "4"), mask_offpolicy=True)
    assert s.tokens == [1, 2, 3, 4, 5, 6] and s.response_length == 3 and s.weight_versions == [3, 4]
    assert s.loss_mask == [0, 0, 1] and s.rollout_log_probs == [-0.1] * 3 and s.response == "xxx"
    with pytest.raises(RuntimeError, match="output_token_logprobs"):
        append_segment(s, {"output_ids": [1], "meta_info": {"output_token_logprobs": []}}, False)
    reset_sample(s)
    assert s.tokens == [1, 2, 3] and s.response_length == 0 and s.weight_versions == [] and s.loss_mask == []


def test_health_checks_of_ray_placed_engines_never_stall_the_event_loop(toy_model_dir, tmp_path):
    """Issue 15: with Ray placement, whether an engine's process still runs is a remote call (its
    Ray host's ``poll``) that can take seconds; the monitor makes it in a thread. Here the poll
    returns only once the loop has run something else: a poll made on the loop itself would give
    up after its deadlock breaker, seeing the loop never ran."""
    import threading

    from rollout_manager.engines import EngineFleet, ManagedEngine

    entered, loop_ran = threading.Event(), threading.Event()
    seen: list[bool] = []

    class SlowRemoteProcess:  # rollout_manager.placement.RayProcess's interface: poll() is a Ray call
        returncode = None

        def poll(self):
            entered.set()
            seen.append(loop_ran.wait(timeout=20))
            return None

    _, settings = make_args(["--hf-checkpoint", str(toy_model_dir)])

    async def go() -> None:
        fleet = EngineFleet(settings, None, tmp_path)
        eng = ManagedEngine(0, "http://127.0.0.1:9", ["engine"], process=SlowRemoteProcess(), host=object())
        fleet.engines = [eng]
        check = asyncio.ensure_future(fleet.check(eng))
        await asyncio.to_thread(entered.wait, 20)
        loop_ran.set()  # runs only if the loop is free while the poll waits
        await check
        assert eng.failures == 1  # nothing listens there: one failed health check, no restart yet

    asyncio.run(go())
    assert seen == [True]
