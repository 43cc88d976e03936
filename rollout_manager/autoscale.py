"""The fleet follows the Ray cluster (``--rollout-fleet-autoscale``): engines for a node that joins,
none left on a node that leaves.

Each ``--health-check-interval`` the autoscaler reads Ray's node list (``ray.nodes()``, a blocking
GCS call: in a worker thread, so the manager's loop goes on) and compares it with the last one:

- a node that joined (a node id not seen before: a node that comes back after a crash has a new
  one) gets as many engines as its total resources hold bundles (``placement.engines_fitting``),
  as long as the fleet stays within ``--rollout-fleet-max-engines``. They are placed on that node
  (``EngineFleet.add(node_ip=...)``) and, as every added engine, stay out of the router until the
  next push gave them the fleet's weight version. A node whose room other actors took meanwhile
  gets none: the placement gives up after ``_PLACE_S`` and the node counts as seen;
- a node that left (gone from the list, or no longer alive) takes its engines out of the fleet
  (``EngineFleet.remove``: the router first); the next push leaves them out of the weight-update
  group. The fleet's last engine stays (a run needs one; the monitor keeps restarting it).

The nodes present at the first read are the fleet's own: the engines started with the fleet
already use them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from rollout_manager.engines import EngineFleet

log = logging.getLogger(__name__)
_PLACE_S = 30.0  # how long a joined node's engines may wait for their placement


def _ray_nodes() -> list[dict[str, Any]]:
    import ray

    return ray.nodes()


class FleetAutoscaler:
    """Adds engines on nodes that join the Ray cluster and removes those of nodes that leave it.
    ``nodes``: what lists the cluster's nodes (``ray.nodes()``'s form); blocking, called in a thread."""

    def __init__(self, fleet: EngineFleet, nodes: Callable[[], list[dict[str, Any]]] = _ray_nodes):
        self.fleet, self._nodes = fleet, nodes
        e = fleet.settings.engines
        from rollout_manager.placement import engine_bundle
        self.bundle = engine_bundle(e.rollout_num_gpus_per_engine if e.rollout_num_gpus else 0, e.ray_resources())
        self.max_engines = e.rollout_fleet_max_engines
        self.seen: set[str] | None = None  # node ids read so far (None: not read yet)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.fleet.settings.engines.health_check_interval)
            try:
                await self.poll()
            except Exception as e:  # noqa: BLE001 - reported; the next round reads the cluster again
                log.error("fleet autoscaler: %s: %s", type(e).__name__, e)

    async def poll(self) -> None:
        """One round: read the node list, remove the engines of nodes gone, add engines on nodes new."""
        alive = {n["NodeID"]: n for n in await asyncio.to_thread(self._nodes) if n.get("Alive")}
        if self.seen is None:
            self.seen = set(alive)
            return
        for eng in [x for x in self.fleet.engines if x.node_id is not None and x.node_id not in alive]:
            if len(self.fleet.engines) == 1:
                log.error("engine %d's node left the cluster; it is the fleet's last engine, so it stays (the run "
                          "waits for it to come back)", eng.index)
                continue
            log.warning("engine %d's node %s left the cluster; removing it from the fleet", eng.index, eng.node_id)
            await self.fleet.remove(eng.url)
        for node_id in [n for n in alive if n not in self.seen]:
            self.seen.add(node_id)
            await self._grow_on(alive[node_id])
        self.seen &= set(alive)

    async def _grow_on(self, node: dict[str, Any]) -> None:
        from rollout_manager.placement import engines_fitting

        ip = node["NodeManagerAddress"]
        count = min(engines_fitting(node.get("Resources", {}), self.bundle), self.max_engines - len(self.fleet.engines))
        if count < 1:
            log.info("node %s joined; no engine for it (room for %d, the fleet has %d of at most %d)", ip,
                     engines_fitting(node.get("Resources", {}), self.bundle), len(self.fleet.engines), self.max_engines)
            return
        try:
            urls = await self.fleet.add(count, node_ip=ip, place_timeout=_PLACE_S)
        except (RuntimeError, OSError) as e:
            log.error("node %s joined; starting %d engine(s) there failed: %s", ip, count, e)
            return
        self.fleet.events.append(f"node {ip} joined: {len(urls)} engine(s) added")
        log.warning("node %s joined: %d engine(s) added there (%s)", ip, len(urls), ", ".join(urls))
