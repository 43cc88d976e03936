"""The embedded engine hosted by a Ray actor (what the rollout manager can start): it serves the
same HTTP API at the URL it reports, and shuts down cleanly.

Needs loopback sockets: run inside ``unshare -n`` as CI does (see _fixtures_engine)."""

from __future__ import annotations

import pytest

from _fixtures_engine import engine_model, run  # noqa: F401
from embedded_engine import EngineSettings
from sglang_protocol.client import EngineClient

ray = pytest.importorskip("ray")


def test_engine_actor_serves_and_shuts_down(engine_model):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        from embedded_engine.actor import start_engine_actor

        handle, url = start_engine_actor(EngineSettings(model_path=str(engine_model), port=0, num_threads=1,
                                                        random_seed=0), num_cpus=1)
        assert url.startswith("http://127.0.0.1:")

        async def go():
            async with EngineClient(url, timeout=60) as c:
                r = await c.generate(input_ids=[5, 6, 7],
                                     sampling_params={"temperature": 0, "max_new_tokens": 5, "ignore_eos": True})
                return r, await c.model_info()

        r, info = run(go())
        assert r["meta_info"]["completion_tokens"] == 5 and info["model_path"] == str(engine_model.resolve())
        assert ray.get(handle.load.remote())["num_reqs"] == 0
        assert ray.get(handle.weight_version.remote()) == "default"
        ray.get(handle.shutdown.remote(), timeout=60)

        async def gone():
            async with EngineClient(url, timeout=5) as c:
                return await c.health(timeout=2)

        assert run(gone()) is False
        ray.kill(handle)
    finally:
        ray.shutdown()
