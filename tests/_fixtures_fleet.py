"""A running engine fleet with a weight sender, as the fleet tests use it: embedded engines started by
``EngineFleet``, the real sglang-router, a real ``WeightSender`` (gloo) pushing the toy model's
weights (tests/test_reliability_engine_restart.py, tests/test_fleet_elastic.py)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from _fixtures_rollout import make_args
from rollout_manager.engines import EngineFleet
from rollout_manager.router import Router
from sglang_protocol.client import EngineClient


@dataclass
class FleetRig:
    router: Router
    fleet: EngineFleet
    sender: Any  # weight_sync.sender.WeightSender
    model: Any  # the toy model whose weights are pushed

    async def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in a worker thread (the sender's calls block)."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def push(self, version: int) -> dict[str, float]:
        """Push the model's weights as ``version`` to the sender's engines; the push's metrics."""
        return await self.call(self.sender.push, self.model.named_parameters(), version)


@contextlib.asynccontextmanager
async def fleet_with_sender(model_dir: Path, log_dir: Path, engines: int) -> AsyncIterator[FleetRig]:
    """``engines`` embedded engines started and registered (health checks every 0.2 s), the sender
    connected to them; everything stopped afterwards whatever happens."""
    from transformers import AutoModelForCausalLM

    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    _, settings = make_args(["--hf-checkpoint", str(model_dir), "--rollout-num-engines", str(engines),
                             "--health-check-interval", "0.2", "--engine-extra-args", "--max-running-requests 8"])
    router = Router.start(policy="round_robin", health_check_interval=1.0, log_path=log_dir / "router.log")
    fleet = EngineFleet(settings, router, log_dir)
    rig = FleetRig(router, fleet, WeightSender(WeightSyncSettings(transport="distributed", backend="gloo",
                                                                  timeout_s=20)), model)
    try:
        await fleet.start()
        await rig.call(rig.sender.connect, fleet.urls)
        yield rig
    finally:
        await rig.call(rig.sender.close)
        await fleet.stop()
        router.stop()


async def wait_event(fleet: EngineFleet, event: str, timeout: float = 120.0) -> None:
    """Until the fleet's monitor logged ``event`` (``EngineFleet.events``)."""
    async def poll() -> None:
        while event not in fleet.events:
            await asyncio.sleep(0.05)
    await asyncio.wait_for(poll(), timeout)


async def versions_via_router(router: Router, n: int) -> set[str]:
    """The weight versions that ``n`` one-token generations through the router met."""
    async with EngineClient(router.url, timeout=60) as c:
        outs = await asyncio.gather(*(c.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})
                                      for _ in range(n)))
    return {o["meta_info"]["weight_version"] for o in outs}
