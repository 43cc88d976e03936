"""An elastic fleet (issue 27): engines added to and removed from a running fleet. A new engine
stays out of the router until a push gave it the fleet's weight version; the sender follows the
fleet (``WeightSender.set_engines``), rebuilding the weight-update group; a removed engine leaves
the router before it ends.

Real components, as in tests/test_reliability_engine_restart.py: embedded engines started by the
fleet, the real sglang-router, a real WeightSender (gloo). The launcher-level case (admin calls to
the rollout manager while a run trains on a three-node cluster) is
tests/test_multinode.py::test_engines_added_and_removed_mid_run_serve_only_current_weights_and_every_group_trains_once.
"""

from __future__ import annotations

import asyncio

import pytest

from _fixtures_rollout import make_args
from rollout_manager.engines import EngineFleet
from rollout_manager.router import Router
from test_reliability_engine_restart import _versions_via_router, _wait_event

pytest.importorskip("sglang_router")


def test_an_added_engine_serves_only_after_a_push_and_a_removed_one_leaves_the_router_first(toy_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    model = AutoModelForCausalLM.from_pretrained(toy_model_dir)
    _, settings = make_args(["--hf-checkpoint", str(toy_model_dir), "--rollout-num-engines", "1",
                             "--health-check-interval", "0.2", "--engine-extra-args", "--max-running-requests 8"])

    async def go() -> None:
        router = Router.start(policy="round_robin", health_check_interval=1.0, log_path=tmp_path / "router.log")
        fleet = EngineFleet(settings, router, tmp_path)
        sender = WeightSender(WeightSyncSettings(transport="distributed", backend="gloo", timeout_s=20))
        loop = asyncio.get_running_loop()
        try:
            await fleet.start()
            first = fleet.urls[0]
            await loop.run_in_executor(None, sender.connect, fleet.urls)
            await loop.run_in_executor(None, sender.push, model.named_parameters(), 1)

            [added] = await fleet.add(1)
            assert fleet.urls == [first, added] and fleet.engines[1].index == 1
            await _wait_event(fleet, "engine 1 awaiting weights v1")  # it serves its checkpoint: kept out
            assert [w["url"] for w in await router.list_workers()] == [first]
            assert await _versions_via_router(router, 6) == {"1"}

            await loop.run_in_executor(None, sender.set_engines, fleet.urls, [1, 1])
            out = await loop.run_in_executor(None, sender.push, model.named_parameters(), 2)
            assert out["weight_sync/engines"] == 2 and out["weight_sync/revived"] == 1  # the group took it in
            await _wait_event(fleet, "engine 1 re-registered")
            assert sorted(w["url"] for w in await router.list_workers()) == sorted([first, added])
            assert await _versions_via_router(router, 6) == {"2"}

            await fleet.remove(first)
            assert fleet.urls == [added] and "engine 0 removed from the fleet" in fleet.events
            assert [w["url"] for w in await router.list_workers()] == [added]
            await loop.run_in_executor(None, sender.set_engines, fleet.urls, [1])
            out = await loop.run_in_executor(None, sender.push, model.named_parameters(), 3)
            assert out["weight_sync/engines"] == 1 and out["weight_sync/attempts"] == 1  # rebuilt without it
            assert await _versions_via_router(router, 4) == {"3"}
            with pytest.raises(ValueError, match="the fleet's last engine"):
                await fleet.remove(added)
        finally:
            await loop.run_in_executor(None, sender.close)
            await fleet.stop()
            router.stop()
    asyncio.run(go())
