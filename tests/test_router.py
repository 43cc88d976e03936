"""The sglang-router as the manager starts it (rollout_manager/router.py): every policy the
``--router-policy`` flag offers starts, the one it leaves out does not, the router's CPU time is
readable (bench/rollout.py measures its cost per request with it), and a busy router writes no
line per request to its log.

Needs loopback sockets: run inside ``unshare -n`` as CI does."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_manager.arguments import add_arguments
from embedded_engine.launch import wait_healthy
from sglang_protocol.client import EngineClient, EngineError
from rollout_manager.router import Router
from sglang_protocol.net import free_port
from rollout_manager.settings import ROUTER_POLICIES

pytest.importorskip("sglang_router")


@pytest.mark.parametrize("policy", ROUTER_POLICIES)
def test_every_offered_policy_starts(policy, tmp_path):
    router = Router.start(policy=policy, health_check_interval=1.0, log_path=tmp_path / "router.log", timeout=30)
    try:
        assert router.process.poll() is None
        assert asyncio.run(router.list_workers()) == []
    finally:
        router.stop()
    assert router.process.poll() is not None


def test_only_our_handle_may_change_the_workers(tmp_path):
    """A router started here takes /workers calls with its control-plane key only (our handle has it);
    requests need none. The key cannot be replaced through --sglang-router-*."""
    router = Router.start(policy="round_robin", health_check_interval=1.0, log_path=tmp_path / "router.log", timeout=30)

    async def go():
        for key in (None, "guess"):  # no key, or another one
            async with EngineClient(router.url, timeout=10, api_key=key) as c:
                for method, body in (("GET", None), ("POST", {"url": "http://127.0.0.1:1"})):
                    with pytest.raises(EngineError) as e:
                        await c.request(method, "/workers", body)
                    assert e.value.status == 401
                assert await c.health(timeout=5)  # probes and requests need no key
        return await router.list_workers()
    try:
        assert asyncio.run(go()) == []
        # the key is on no command line (readable by every local user): not the one it was started
        # with, nor what the process shows now (sglang-router renames itself once it runs)
        assert router.admin_key not in " ".join(router._launch[0])
        assert router.admin_key not in Path(f"/proc/{router.process.pid}/cmdline").read_bytes().decode()
    finally:
        router.stop()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    from rollout_manager.arguments import settings_from_args
    with pytest.raises(ValueError, match="--sglang-router-control-plane-api-keys"):
        settings_from_args(parser.parse_args([]), ["--router-control-plane-api-keys", "a:b:admin:c"])


def test_power_of_two_is_not_offered_because_it_cannot_start_empty(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--router-policy", "power_of_two"])
    # why: the manager starts the router before registering engines, and sglang-router 0.3.2 exits at
    # start-up with power_of_two and no workers. If a newer router accepts it, offer it again.
    with pytest.raises(RuntimeError, match="exited with code"):
        Router.start(policy="power_of_two", health_check_interval=1.0, log_path=tmp_path / "router.log", timeout=30)


def test_env_reaches_the_router(tmp_path):
    def threads(env: dict[str, str]) -> int:
        router = Router.start(policy="round_robin", health_check_interval=1.0, log_path=tmp_path / "router.log",
                              timeout=30, env=env)
        try:
            return len(list(Path(f"/proc/{router.process.pid}/task").iterdir()))
        finally:
            router.stop()
    assert threads({"TOKIO_WORKER_THREADS": "5"}) - threads({"TOKIO_WORKER_THREADS": "1"}) >= 3  # tokio workers (4 more)


@pytest.mark.parametrize("log_level", [None, "info"])
def test_router_cpu_time_and_quiet_log(toy_model_dir, tmp_path, log_level):
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "embedded_engine.instant", "--port", str(port),
                               "--model-path", str(toy_model_dir), "--num-tokens", "8"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = tmp_path / "router.log"
    extra = ["--log-level", log_level] if log_level else []  # extra_args: a repeated flag overrides ours
    router = Router.start(policy="round_robin", health_check_interval=1.0, log_path=log, timeout=30,
                          extra_args=extra)
    n = 400
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 60, engine)

        async def go() -> tuple[float, float]:
            await router.add_worker(f"http://127.0.0.1:{port}")
            async with EngineClient(router.url, timeout=30) as c:
                before = router.cpu_seconds()
                outs = await asyncio.gather(*[c.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 8})
                                              for _ in range(n)])
                after = router.cpu_seconds()
            assert all(o["output_ids"] == [10] * 8 for o in outs)
            return before, after
        before, after = asyncio.run(go())
    finally:
        router.stop()
        engine.terminate()
        engine.wait(10)
    assert before is not None and after is not None
    assert after > before  # it did work for the requests (its cost per request is bench/rollout.py's)
    assert Router.attach("127.0.0.1", 1).cpu_seconds() is None  # not ours: nothing to read
    # our --log-level warn: no line per request (at info, two per request: ~0.4 kB of disk per request
    # and ~20% more router CPU)
    text = log.read_text(errors="replace")
    if log_level is None:
        assert text.count("/generate") < n // 10, text[-2000:]
    else:
        assert text.count("/generate") >= n, text[-2000:]


@pytest.mark.parametrize("mini_lb", [False, True])
def test_the_launcher_imports_the_python_balancer_only_for_mini_lb(mini_lb):
    """sglang-router's launch_router imports its Python debugging balancer (FastAPI, uvicorn, and
    SGLang where installed: seconds of start-up); the launch command leaves it out unless asked."""
    from rollout_manager.router import _KEY_ENV, _LAUNCH_WITH_KEY

    out = subprocess.run([sys.executable, "-X", "importtime", "-c", _LAUNCH_WITH_KEY, "--help"]
                         + (["--mini-lb"] if mini_lb else []), env={**os.environ, _KEY_ENV: "k"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--policy" in out.stdout  # its own --help: the launcher ran
    assert (" fastapi" in out.stderr) == mini_lb
