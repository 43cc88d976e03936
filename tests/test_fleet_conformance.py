"""The engine fleet as SGLang servers meet it: weight-update ranks of TP engines, API keys on
every client, the router's health checks, the engines' environment, start-up refusals.

Where SGLang's behaviour is the point, the servers are the conformance tier's oracle engines
(``tests/sglang_oracle/oracle_engine.py``: SGLang's own HTTP app with its API-key middleware and
``/server_info``, and per TP rank a process running SGLang's own weight updater, which joins the
weight-update group as ``rank_offset + tp_rank``); the router, Ray, the trainer rank and the
weight sender are the real ones.

Opens loopback sockets (Ray, gloo, the router): run under ``unshare -n``, as CI does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
from pathlib import Path

import pytest
from aiohttp import web

from _fixtures_rollout import make_args
from rollout_manager.dispatch import Dispatcher
from rollout_manager.engines import EngineFleet, ManagedEngine
from scripts.arguments import parse, parse_args
from sglang_oracle import running_oracles
from sglang_protocol.client import EngineClient
from weight_sync.interfaces import WeightSyncSettings
from weight_sync.sender import WeightSender

KEYS = ["--sglang-api-key", "k1", "--sglang-admin-api-key", "k2"]  # the oracle engine's keys


@pytest.fixture(scope="module")
def oracle(toy_model_dir, tmp_path_factory):
    """An SGLang oracle engine with TP=2 (two rank processes) and --api-key k1 --admin-api-key k2."""
    with running_oracles(toy_model_dir, tmp_path_factory.mktemp("oracle"),
                         {"tp2": (2, ("--api-key", "k1", "--admin-api-key", "k2"))}) as urls:
        yield urls["tp2"]


def _seen(url: str) -> dict:
    """What an oracle engine was sent: ``generate`` bodies and the control calls, in order."""
    async def go():
        async with EngineClient(url, timeout=30, api_key="k1") as c:
            return await c.request("GET", "/oracle/requests")
    return asyncio.run(go())


@contextlib.contextmanager
def json_server(routes: dict[str, dict]):
    """A server answering GET ``path`` with ``routes[path]`` (for /server_info shapes SGLang's parser
    does not produce), on a thread of this process; yields its URL."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    for path, body in routes.items():
        app.router.add_get(path, lambda request, body=body: web.json_response(body))
    runner = web.AppRunner(app)
    started = threading.Event()
    url = []

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        url.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        started.set()
        loop.run_forever()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(30)
    try:
        yield url[0]
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture()
def base(toy_model_dir):
    return ["--hf-checkpoint", str(toy_model_dir), "--prompt-data", str(toy_model_dir / "data/train.jsonl")]


@pytest.fixture(scope="module")
def ray_env():
    """A local Ray cluster whose workers have variables a GPU node has (NCCL_*, HF_*), and an
    allocator setting meant for the trainer (PYTORCH_CUDA_ALLOC_CONF)."""
    import ray

    tests = Path(__file__).resolve().parent
    env = {"PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")]),
           "NCCL_DEBUG": "WARN", "HF_HOME": "/nonexistent/hf", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             namespace="reservoir-fleet-tests", _node_ip_address="127.0.0.1", runtime_env={"env_vars": env})
    try:
        yield ray
    finally:
        ray.shutdown()


# --- 3: weight-update ranks ------------------------------------------------------------------
def test_engine_gpus_from_the_flag_or_from_server_info(oracle):
    from rollout_manager.engines import engine_gpus

    _, s = make_args(["--rollout-engine", "sglang", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2"])
    assert asyncio.run(engine_gpus(s, ["http://a:1", "http://b:1"])) == [2, 2]  # engines started here
    _, s = make_args(["--rollout-num-engines", "2"])
    assert asyncio.run(engine_gpus(s, ["http://a:1", "http://b:1"])) == [1, 1]  # embedded: one rank each
    _, s = make_args(["--rollout-engine", "sglang", "--engine-urls", oracle, *KEYS])
    assert asyncio.run(engine_gpus(s, [oracle])) == [2]  # SGLang's own /server_info (it needs the key)
    with json_server({"/server_info": {"tp_size": 2, "pp_size": 2}}) as pp2, json_server({"/server_info": {}}) as bare:
        _, s = make_args(["--engine-urls", pp2, bare])
        assert asyncio.run(engine_gpus(s, [pp2, bare])) == [4, 1]  # tp x pp; a missing field counts 1


def test_launcher_joins_a_tp2_engine_with_one_rank_per_gpu_and_its_keys(ray_env, base, oracle):
    """The launcher's weight-sync wiring (Run._connect_weight_sync -> trainer rank 0 ->
    WeightSender.connect) into a TP-2 SGLang engine: SGLang's own updaters join as ranks 1 and 2
    of 3 only if the engine's GPU count reached the sender (with 1, TP rank 1 is outside the
    world); its admin endpoints take only the admin key."""
    from scripts.components import Run

    before = _seen(oracle)["control"]
    run = Run(*parse(base + ["--rollout-engine", "sglang", "--engine-urls", oracle, *KEYS,
                                 "--update-weight-timeout", "30"]))
    run.engine_urls = [oracle]  # what the rollout manager's start() returns for --engine-urls
    run._start_trainer()
    try:
        run._connect_weight_sync()  # both TP ranks met trainer rank 0
    finally:
        run.trainer.close()
    control = _seen(oracle)["control"][len(before):]
    assert control == ["init_weights_update_group", "destroy_weights_update_group"]


def test_weight_sync_settings_carry_the_engines_keys(base):
    """The launcher gives the weight sender the keys of the rollout settings (the pass-through)."""
    from rollout_manager.arguments import settings_from_args as rollout_settings
    from weight_sync.arguments import settings_from_args as sync_settings

    args = parse_args(base + ["--rollout-engine", "sglang", "--engine-urls", "http://127.0.0.1:1", *KEYS])
    e = rollout_settings(args, args.sglang_args).engines
    sync = sync_settings(args, e.api_key, e.admin_api_key)
    assert (sync.api_key, sync.admin_api_key) == ("k1", "k2")


# --- 5: --check-weight-update-equal ------------------------------------------------------------
def test_check_weight_update_equal_accepted_for_sglang(base):
    """SGLang servers are compared by a read-back (``/get_weights_by_name``): the flag is not refused."""
    args = parse_args(base + ["--rollout-engine", "sglang", "--rollout-num-gpus", "1", "--check-weight-update-equal"])
    assert args.check_weight_update_equal


def test_check_weight_update_equal_reads_back_with_the_admin_key_and_pauses_nothing_at_connect(oracle):
    """At connect the sender finds out how it can compare with an SGLang server (no
    ``/weights_checksum``): one read-back probe, sent with the admin key SGLang requires; nothing
    is paused."""
    before = _seen(oracle)["control"]
    settings = WeightSyncSettings(check_equal=True, timeout_s=30, api_key="k1", admin_api_key="k2")
    with WeightSender(settings) as sender:
        sender.connect([oracle])
        assert sender.engines[0].check == "readback"
    assert "pause_generation" not in _seen(oracle)["control"][len(before):]


# --- 7: the engines' environment --------------------------------------------------------------
_DUMP_ENV = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"


def test_ray_placed_engines_inherit_the_node_environment(ray_env, tmp_path):
    from rollout_manager.placement import place_engine_hosts, release

    pg, [host] = place_engine_hosts(1, 0, timeout=60)
    try:
        out = tmp_path / "env.json"
        ray_env.get(host.start.remote([sys.executable, "-c", _DUMP_ENV, str(out)], {"ENGINE_OWN": "1"},
                                      str(tmp_path / "engine.log")), timeout=60)
        assert ray_env.get(host.wait.remote(60), timeout=90) == 0
        # a port block for --dist-init-addr on the engine's node, clear of the ports already handed out
        port = ray_env.get(host.free_port.remote(20000, 4, [20000, 20003]), timeout=60)
        assert port >= 20004
    finally:
        release(pg, [host])
    env = json.loads(out.read_text())
    assert (env["NCCL_DEBUG"], env["HF_HOME"], env["ENGINE_OWN"]) == ("WARN", "/nonexistent/hf", "1")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env  # the trainer's allocator setting stays with the trainer


def test_local_engines_inherit_the_environment_but_the_allocator_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    _, s = make_args([])
    out = tmp_path / "env.json"
    eng = ManagedEngine(0, "http://127.0.0.1:1", [sys.executable, "-c", _DUMP_ENV, str(out)], {"ENGINE_OWN": "1"},
                        log_path=tmp_path / "engine.log")
    EngineFleet(s, router=None, log_dir=tmp_path)._spawn(eng)
    assert eng.process.wait(60) == 0
    env = json.loads(out.read_text())
    assert (env["NCCL_DEBUG"], env["ENGINE_OWN"]) == ("INFO", "1") and "PYTORCH_CUDA_ALLOC_CONF" not in env


# --- 9, 10, 11: the router, API keys ----------------------------------------------------------
@pytest.mark.parametrize("argv,msg", [
    (["--sglang-router-policy", "random"], "--sglang-router-policy: .*use --router-policy"),
    (["--sglang-router-host", "0.0.0.0"], "--sglang-router-host"),
    (["--sglang-router-ip", "127.0.0.1", "--sglang-router-port", "1", "--sglang-router-request-timeout-secs", "9"],
     "with --sglang-router-ip a running router is used"),
])
def test_router_pass_through_refusals_name_the_flags(argv, msg):
    with pytest.raises(ValueError, match=msg):
        make_args(argv)


def test_router_pass_through_needs_no_sglang_engines():
    _, s = make_args(["--sglang-router-request-timeout-secs", "14400", "--rollout-batch-size", "4"])
    assert s.engines.router_args == ["--request-timeout-secs", "14400"] and s.engines.sglang_args == []
    assert s.sampling.rollout_batch_size == 4  # the router fronts embedded engines too


def test_router_gets_the_pass_through_calls_engines_with_their_keys_and_leaves_health_to_the_fleet(
        tmp_path, oracle):
    """One router as the manager starts it, with slime's --sglang-router-* flags, in front of an
    SGLang engine that has both keys; the fleet registers it, the direct dispatcher calls it."""
    pytest.importorskip("sglang_router")
    import argparse

    from sglang_router.router_args import RouterArgs

    from rollout_manager.router import Router

    url = oracle
    before = len(_seen(url)["generate"])
    _, s = make_args(["--rollout-engine", "sglang", "--engine-urls", url, *KEYS,
                      "--sglang-router-request-timeout-secs", "14400", "--sglang-router-balance-abs-threshold", "10",
                      "--sglang-router-disable-circuit-breaker"])
    assert (s.engines.api_key, s.engines.admin_api_key) == ("k1", "k2")
    assert s.engines.sglang_args == ["--api-key", "k1", "--admin-api-key", "k2"]  # no --router-* for SGLang

    async def go():
        router = Router.start(policy="round_robin", health_check_interval=1.0, log_path=tmp_path / "router.log",
                              extra_args=s.engines.router_args)
        fleet = EngineFleet(s, router, tmp_path)
        try:
            await fleet.start()
            [worker] = await router.list_workers()
            assert worker["disable_health_check"] is True  # the fleet's monitor is the one judge
            async with EngineClient(router.url, timeout=30) as c:  # the router calls the engine with k1
                out = await c.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2})
            assert len(out["output_ids"]) == 2
            direct = Dispatcher(EngineClient(router.url), lambda: fleet.urls, True, 30,
                                api_key=s.engines.api_key, admin_api_key=s.engines.admin_api_key)
            try:
                picked, client = direct.pick(set())
                assert picked == url
                await client.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2})  # normal: k1
                await client.abort_request(abort_all=True)  # admin: only k2 opens it
            finally:
                await direct.router.close()
                await direct.close()
            return router.process.args  # the command Router.start ran (it took the flags: it is up)
        finally:
            await fleet.stop()
            router.stop()
    cmd = asyncio.run(go())
    seen = _seen(url)
    assert len(seen["generate"]) == before + 2 and "abort_request" in seen["control"]
    parser = argparse.ArgumentParser()  # the router's own parser (sglang_router.launch_router.parse_router_args)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    parsed = RouterArgs.from_cli_args(parser.parse_args(cmd[3:]), use_router_prefix=False)
    assert (parsed.request_timeout_secs, parsed.balance_abs_threshold, parsed.disable_circuit_breaker) == \
        (14400, 10, True)


# --- 11: the top-p / top-k warning ----------------------------------------------------------------
@pytest.mark.parametrize("extra,warned", [
    (["--rollout-top-p", "0.9"], True), (["--rollout-top-k", "20"], True), ([], False),
    (["--rollout-top-p", "0.9", "--debug-rollout-only"], False),  # nothing is trained
])
def test_truncated_sampling_warns_at_start_of_training(base, caplog, extra, warned):
    with caplog.at_level("WARNING"):
        parse_args(base + extra)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert ("untruncated distribution" in text and "--rollout-top-p" in text and "--rollout-top-k" in text) == warned
