"""The rollout manager as a Ray actor, so the launcher runs it in its own process.

    handle = create_rollout_manager_actor(settings, args)
    ray.get(handle.start.remote())                      # engines + router; returns the engine URLs
    groups, metrics = ray.get(handle.generate.remote(0))
    ray.get(handle.push.remote(1, "reservoir-buffer"))  # into a named buffer actor
    ray.get(handle.pause.remote()); ...; ray.get(handle.resume.remote())  # around weight updates

It is an async actor: ``pause``/``resume`` run while a ``push`` is generating. In async training the
launcher's producer thread (``scripts/producer.py``) calls ``push`` step after step, waiting on the
buffer's ``wait_weight_version`` to stay within the staleness bound; the buffer's back-pressure
(``put`` waits while it is full) paces it.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from buffer.ray_errors import creation_setting_error
from buffer.sample import Sample
from rollout_manager.manager import RolloutManager
from rollout_manager.settings import RolloutSettings


def _buffer(buffer: Any) -> Any:
    """A buffer handle from a handle or a buffer actor name."""
    if isinstance(buffer, str):
        from buffer.interfaces import get_buffer
        return get_buffer(buffer)
    return buffer


class RolloutManagerActor:
    """Ray actor wrapper of ``RolloutManager`` (same method names; buffers by handle or name)."""

    def __init__(self, settings: RolloutSettings, args: argparse.Namespace, log_dir: str | None = None):
        self._m = RolloutManager(settings, args, log_dir)

    async def start(self) -> list[str]:
        """Start (or attach to) the router and start the engines; returns the engine URLs.

        Raises RuntimeError when called a second time.
        """
        await self._m.start()
        return self._m.engine_urls

    async def engine_urls(self) -> list[str]:
        """The engines' URLs (empty before ``start``)."""
        return self._m.engine_urls

    async def engine_restarts(self) -> dict[str, int]:
        """Per engine URL, how often the fleet restarted it (``RolloutManager.engine_restarts``)."""
        return self._m.engine_restarts()

    async def add_engines(self, count: int) -> list[str]:
        """Admin: start ``count`` more engines while the run goes on; their URLs. Each serves only
        once a push gave it the current weights (the launcher pushes to the fleet's engines of the
        moment). From another Ray driver: ``ray.get_actor(f"{buffer_name}-rollout", namespace="reservoir")``."""
        return await self._m.add_engines(count)

    async def remove_engine(self, url: str) -> None:
        """Admin: take the engine at ``url`` out of the router and end it (its requests are retried on the others)."""
        await self._m.remove_engine(url)

    async def router_url(self) -> str | None:
        """The router's base URL (http://host:port); None before ``start``."""
        return self._m.router_url

    async def generate(self, rollout_id: int, evaluation: bool = False) -> tuple[list[list[Sample]], dict]:
        """One rollout step: its groups and their ``rollout/...`` metrics (``RolloutManager.generate``)."""
        return await self._m.generate(rollout_id, evaluation)

    async def evaluate(self, rollout_id: int) -> dict[str, float]:
        """One evaluation pass: its ``eval/...`` metrics (``RolloutManager.evaluate``)."""
        return await self._m.evaluate(rollout_id)

    async def push(self, rollout_id: int, buffer: Any) -> dict[str, float]:
        """Generate step ``rollout_id`` into ``buffer`` (a handle or a buffer actor's name); returns its metrics.

        Groups the buffer gave back as stale are regenerated first; waits while the buffer is full.
        """
        return await self._m.push(rollout_id, _buffer(buffer))

    async def pause(self) -> None:
        """Before a weight update: stop sending requests and abort the running ones (they resume after ``resume``)."""
        await self._m.pause()

    async def resume(self) -> None:
        """Let generation continue after ``pause`` (under the engines' new weights)."""
        await self._m.resume()

    async def state_dict(self) -> dict[str, Any]:
        """The data source's state for a checkpoint (a slime data source without ``state_dict`` saves itself)."""
        return self._m.state_dict()

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the data source from what ``state_dict`` returned."""
        self._m.load_state_dict(state)

    async def kill(self, target: str) -> None:
        """Fault injection: SIGKILL the router this manager started (``"router"``) or engine 0 (``"engine"``)."""
        self._m.kill(target)

    async def shutdown(self) -> None:
        """Stop the engines and the router this manager started."""
        await self._m.shutdown()

    async def ping(self) -> bool:
        """True once the actor is up (``create_rollout_manager_actor`` waits on it to surface construction errors)."""
        await asyncio.sleep(0)
        return True


def create_rollout_manager_actor(settings: RolloutSettings, args: argparse.Namespace, log_dir: str | None = None,
                                 **ray_options: Any) -> Any:
    """Start the actor (Ray must be initialised). Configuration errors (bad plugin paths, bad prompt
    files) raise here, in the caller, as ``ValueError``."""
    import ray

    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 64}  # waits on HTTP; engines are its children
    options.update(ray_options)
    handle = ray.remote(RolloutManagerActor).options(**options).remote(settings, args, log_dir)
    try:
        ray.get(handle.ping.remote())
    except ray.exceptions.RayActorError as e:
        setting = creation_setting_error(e)
        if setting is not None:
            raise setting from None
        raise
    return handle

