"""An elastic fleet (issue 27): engines added to and removed from a running fleet. A new engine
stays out of the router until a push gave it the fleet's weight version; the sender follows the
fleet (``WeightSender.set_engines``), rebuilding the weight-update group; a removed engine leaves
the router before it ends.

Real components, as in tests/test_reliability_engine_restart.py (the same set-up:
tests/_fixtures_fleet.py): embedded engines started by the fleet, the real sglang-router, a real
WeightSender (gloo). The launcher-level case (admin calls to
the rollout manager while a run trains on a three-node cluster) is
tests/test_multinode.py::test_engines_added_and_removed_mid_run_serve_only_current_weights_and_every_group_trains_once.
"""

from __future__ import annotations

import asyncio

import pytest

from _fixtures_fleet import fleet_with_sender, versions_via_router, wait_event
from _fixtures_rollout import make_args


def test_an_added_engine_serves_only_after_a_push_and_a_removed_one_leaves_the_router_first(toy_model_dir, tmp_path):
    pytest.importorskip("sglang_router")

    async def go() -> None:
        async with fleet_with_sender(toy_model_dir, tmp_path, engines=1) as rig:
            fleet, router, sender = rig.fleet, rig.router, rig.sender
            first = fleet.urls[0]
            await rig.push(1)

            [added] = await fleet.add(1)
            assert fleet.urls == [first, added] and fleet.engines[1].index == 1
            await wait_event(fleet, "engine 1 awaiting weights v1")  # it serves its checkpoint: kept out
            assert [w["url"] for w in await router.list_workers()] == [first]
            assert await versions_via_router(router, 6) == {"1"}

            await rig.call(sender.set_engines, fleet.urls, [1, 1])
            out = await rig.push(2)
            assert out["weight_sync/engines"] == 2 and out["weight_sync/revived"] == 1  # the group took it in
            await wait_event(fleet, "engine 1 re-registered")
            assert sorted(w["url"] for w in await router.list_workers()) == sorted([first, added])
            assert await versions_via_router(router, 6) == {"2"}

            await fleet.remove(first)
            assert fleet.urls == [added] and "engine 0 removed from the fleet" in fleet.events
            assert [w["url"] for w in await router.list_workers()] == [added]
            await rig.call(sender.set_engines, fleet.urls, [1])
            out = await rig.push(3)
            assert out["weight_sync/engines"] == 1 and out["weight_sync/attempts"] == 1  # rebuilt without it
            assert await versions_via_router(router, 4) == {"3"}
            with pytest.raises(ValueError, match="the fleet's last engine"):
                await fleet.remove(added)
    asyncio.run(go())


class _StubFleet:
    """What the autoscaler uses of an ``EngineFleet``: its engines (with their Ray node), ``add`` on a
    node and ``remove``; each call recorded."""

    def __init__(self, settings, node_ids: list[str]):
        from rollout_manager.engines import ManagedEngine

        self.settings, self.events, self.calls = settings, [], []
        self._engine = ManagedEngine
        self.engines = [ManagedEngine(i, f"http://e{i}", None, node_id=n) for i, n in enumerate(node_ids)]

    async def add(self, count: int, node_ip: str | None = None, place_timeout: float | None = None) -> list[str]:
        self.calls.append(("add", count, node_ip))
        node_id = f"id-{node_ip}"
        new = [self._engine(len(self.engines) + k, f"http://e{len(self.engines) + k}", None, node_id=node_id)
               for k in range(count)]
        self.engines = [*self.engines, *new]
        return [e.url for e in new]

    async def remove(self, url: str) -> None:
        self.calls.append(("remove", url))
        self.engines = [e for e in self.engines if e.url != url]


def _node(ip: str, alive: bool = True, **resources: float) -> dict:
    return {"NodeID": f"id-{ip}", "NodeManagerAddress": ip, "Alive": alive,
            "Resources": {"CPU": 1.0, f"node:{ip}": 1.0, **resources}}


def test_the_autoscaler_adds_engines_on_a_joined_node_up_to_the_bound_and_removes_those_of_a_node_that_left():
    """``FleetAutoscaler.poll`` against a node list it is handed (``ray.nodes()``'s form): the nodes of
    the first read are the fleet's own; a node that joins gets the engines its resources hold (one
    per ``rollout=1``), within ``--rollout-fleet-max-engines``; a node without the resource gets
    none; a node that dies (not alive, or gone) takes its engines out of the fleet, but not the
    fleet's last one. The cluster case: tests/test_multinode.py (a real node joins and is killed)."""
    from rollout_manager.autoscale import FleetAutoscaler

    _, settings = make_args(["--hf-checkpoint", "x", "--rollout-engine-placement", "ray", "--rollout-fleet-autoscale",
                             "--rollout-fleet-max-engines", "4", "--rollout-engine-ray-resources", "rollout=1"])
    cluster = [_node("127.0.0.1"), _node("127.0.0.3", CPU=0, rollout=1)]
    fleet = _StubFleet(settings, ["id-127.0.0.3"])
    scaler = FleetAutoscaler(fleet, nodes=lambda: list(cluster))

    async def go() -> None:
        await scaler.poll()
        assert fleet.calls == []  # the nodes at start are the fleet's own
        cluster.extend([_node("127.0.0.4", CPU=0, rollout=2), _node("127.0.0.5")])  # .5: no 'rollout' resource
        await scaler.poll()
        assert fleet.calls == [("add", 2, "127.0.0.4")] and len(fleet.engines) == 3
        await scaler.poll()
        assert len(fleet.calls) == 1  # a node is grown on once
        cluster.append(_node("127.0.0.6", CPU=0, rollout=4))
        await scaler.poll()
        assert fleet.calls[-1] == ("add", 1, "127.0.0.6") and len(fleet.engines) == 4  # the bound
        cluster[2] = _node("127.0.0.4", alive=False, CPU=0, rollout=2)  # it died: its two engines go
        del cluster[-1]  # and .6 is gone from the list
        await scaler.poll()
        assert [c for c in fleet.calls if c[0] == "remove"] == [("remove", "http://e1"), ("remove", "http://e2"),
                                                               ("remove", "http://e3")]
        assert [e.node_id for e in fleet.engines] == ["id-127.0.0.3"]
        del cluster[1]  # the last engine's node: it stays, the run waits for it
        await scaler.poll()
        assert len(fleet.engines) == 1 and len(fleet.calls) == 5
    asyncio.run(go())


def test_autoscale_needs_ray_placement():
    with pytest.raises(ValueError, match="--rollout-fleet-autoscale .*--rollout-engine-placement ray"):
        make_args(["--hf-checkpoint", "x", "--rollout-fleet-autoscale"])
