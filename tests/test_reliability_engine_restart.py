"""A restarted engine is brought to the current weights before it takes work (issue 16, item 3).

Real components: two embedded engines started by the fleet, the real sglang-router, a real
WeightSender (gloo) pushing versions, and a real SIGKILL of one engine.
"""

from __future__ import annotations

import asyncio

import pytest

from _fixtures_fleet import fleet_with_sender, versions_via_router, wait_event
from _fixtures_rollout import make_args
from rollout_manager.engines import EngineFleet
from rollout_manager.router import Router
from sglang_protocol.client import EngineClient

pytest.importorskip("sglang_router")


def test_restarted_engine_stays_out_of_the_router_until_a_push_brings_it_to_the_current_version(
        toy_model_dir, tmp_path):
    async def go() -> None:
        async with fleet_with_sender(toy_model_dir, tmp_path, engines=2) as rig:
            fleet, router = rig.fleet, rig.router
            await rig.push(1)
            assert await versions_via_router(router, 4) == {"1"}

            fleet.kill(0)  # SIGKILL: it restarts from the checkpoint, i.e. version "default"
            await wait_event(fleet, "engine 0 awaiting weights v1")
            assert fleet.engines[0].version == 0 and not fleet.engines[0].registered
            assert [w["url"] for w in await router.list_workers()] == [fleet.engines[1].url]
            assert await versions_via_router(router, 6) == {"1"}  # no request reaches the stale engine
            rounds = fleet.rounds
            while fleet.rounds < rounds + 3:  # and it stays out while nothing is pushed
                await asyncio.sleep(0.05)
            assert not fleet.engines[0].registered

            out = await rig.push(2)
            assert out["weight_sync/engines"] == 2  # the push reached the restarted engine too
            await wait_event(fleet, "engine 0 restarted")
            assert sorted(w["url"] for w in await router.list_workers()) == sorted(fleet.urls)
            assert await versions_via_router(router, 6) == {"2"}
            assert fleet.engines[0].restarts == 1
    asyncio.run(go())


def test_a_dead_router_is_started_again_and_gets_its_engines_back(toy_model_dir, tmp_path):
    """SIGKILL the router mid-run: the monitor starts it again on its address and registers the
    engines again; requests through the same URL are served (issue 16: a crash of any one process)."""
    _, settings = make_args(["--hf-checkpoint", str(toy_model_dir), "--rollout-num-engines", "1",
                             "--health-check-interval", "0.2"])

    async def go() -> None:
        router = Router.start(policy="round_robin", health_check_interval=1.0, log_path=tmp_path / "router.log")
        fleet = EngineFleet(settings, router, tmp_path)
        try:
            await fleet.start()
            assert await versions_via_router(router, 2) == {"default"}
            old_pid = router.process.pid
            router.process.kill()
            await wait_event(fleet, "router restarted")
            await wait_event(fleet, "engine 0 re-registered")
            assert router.process.pid != old_pid and fleet.router_restarts == 1
            assert [w["url"] for w in await router.list_workers()] == fleet.urls
            assert await versions_via_router(router, 2) == {"default"}
        finally:
            await fleet.stop()
            router.stop()
    asyncio.run(go())


def test_a_router_given_by_address_that_restarts_gets_the_engines_back(toy_model_dir, tmp_path):
    """A router the user runs (``--sglang-router-ip``) is not ours to restart. SIGKILLed, the monitor
    reports it down once and admits no engine; started again by its owner on its address, knowing
    none of our workers, it gets the engines back and serves through the same URL."""
    import subprocess
    import sys

    from sglang_protocol.net import free_port

    host, port = "127.0.0.1", free_port("127.0.0.1")

    def users_router() -> subprocess.Popen:  # as a user starts one: no control-plane keys
        with open(tmp_path / "users_router.log", "ab") as log:
            return subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port",
                                     str(port), "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)

    async def listening() -> None:
        while True:
            try:
                _, writer = await asyncio.open_connection(host, port)
                writer.close()
                return
            except OSError:
                await asyncio.sleep(0.1)

    _, settings = make_args(["--hf-checkpoint", str(toy_model_dir), "--rollout-num-engines", "1",
                             "--health-check-interval", "0.2", "--sglang-router-ip", host,
                             "--sglang-router-port", str(port)])
    proc = users_router()

    async def go() -> None:
        nonlocal proc
        await asyncio.wait_for(listening(), 60)
        router = Router.attach(host, port)
        fleet = EngineFleet(settings, router, tmp_path)
        try:
            await fleet.start()
            assert await versions_via_router(router, 2) == {"default"}
            proc.kill()
            await asyncio.to_thread(proc.wait)
            await wait_event(fleet, "router down")
            rounds = fleet.rounds
            while fleet.rounds < rounds + 3:  # still down: said once, the monitor keeps running
                await asyncio.sleep(0.05)
            assert fleet.events.count("router down") == 1
            proc = users_router()
            await wait_event(fleet, "router back")
            await wait_event(fleet, "engine 0 re-registered")
            assert [w["url"] for w in await router.list_workers()] == fleet.urls
            assert await versions_via_router(router, 2) == {"default"}
            assert fleet.router_restarts == 0  # its owner started it, not the fleet
        finally:
            await fleet.stop()
    try:
        asyncio.run(go())
    finally:
        proc.kill()
        proc.wait()


def test_an_engine_a_dead_run_left_paused_serves_the_next_run(toy_model_dir, tmp_path):
    """Engines given by --engine-urls outlive a run; one whose trainer died inside a push leaves
    them paused (the session is the weight sender's to close: tests/test_sglang_conformance.py).
    The next run's fleet continues them when it attaches, so its requests are served."""
    from _fixtures_engine import start_engine, stop_process

    proc, url = start_engine(toy_model_dir)
    try:
        async def pause() -> None:
            async with EngineClient(url, timeout=30) as c:
                await c.pause_generation("abort")
        asyncio.run(pause())
        _, settings = make_args(["--hf-checkpoint", str(toy_model_dir), "--engine-urls", url])

        async def go() -> None:
            router = Router.start(policy="round_robin", health_check_interval=1.0, log_path=tmp_path / "router.log")
            fleet = EngineFleet(settings, router, tmp_path)
            try:
                await fleet.start()
                async with EngineClient(router.url, timeout=60) as c:  # a paused engine would hold it
                    out = await asyncio.wait_for(c.generate(input_ids=[1, 2, 3],
                                                            sampling_params={"max_new_tokens": 2}), 30)
                assert len(out["output_ids"]) == 2
            finally:
                await fleet.stop()
                router.stop()
        asyncio.run(go())
    finally:
        stop_process(proc)
