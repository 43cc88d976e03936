"""The rollout manager as a Ray actor, so the launcher runs it in its own process.

    handle = create_rollout_manager_actor(settings, args)
    ray.get(handle.start.remote())                      # engines + router; returns the engine URLs
    groups, metrics = ray.get(handle.generate.remote(0))
    ray.get(handle.push.remote(1, "reservoir-buffer"))  # into a named buffer actor
    ref = handle.run_async.remote(2, 100, "reservoir-buffer")  # async training: keep producing
    ray.get(handle.pause.remote()); ...; ray.get(handle.resume.remote())  # around weight updates

It is an async actor: ``pause``/``resume``/``stop_async`` run while ``run_async`` is producing.
The buffer's back-pressure (``put`` waits while it is full) paces ``run_async``.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

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
        self._stop_async = False
        self._unread_metrics: list[dict[str, float]] = []

    async def start(self) -> list[str]:
        await self._m.start()
        return self._m.engine_urls

    async def engine_urls(self) -> list[str]:
        return self._m.engine_urls

    async def router_url(self) -> str | None:
        return self._m.router_url

    async def generate(self, rollout_id: int, evaluation: bool = False) -> tuple[list[list[Sample]], dict]:
        return await self._m.generate(rollout_id, evaluation)

    async def evaluate(self, rollout_id: int) -> dict[str, float]:
        return await self._m.evaluate(rollout_id)

    async def push(self, rollout_id: int, buffer: Any) -> dict[str, float]:
        return await self._m.push(rollout_id, _buffer(buffer))

    async def run_async(self, start_rollout_id: int, num_rollout: int, buffer: Any,
                        max_weight_staleness: int | None = None) -> list[dict[str, float]]:
        """Produce rollouts ``start..start+num_rollout-1`` into the buffer; ``stop_async`` ends it early
        (after the step in progress). Returns each step's metrics.

        With ``max_weight_staleness`` K, rollout k starts only once the buffer's weight version is
        >= k - K: the producer runs at most K steps ahead of the trainer, so its groups are fresh
        enough when their turn comes instead of being generated only to be dropped as stale."""
        handle = _buffer(buffer)
        self._stop_async = False
        out = []
        for rid in range(start_rollout_id, start_rollout_id + num_rollout):
            if max_weight_staleness is not None:
                while not self._stop_async and await handle.get_weight_version.remote() < rid - max_weight_staleness:
                    await asyncio.sleep(0.02)
            if self._stop_async:
                break
            out.append(await self._m.push(rid, handle))
            self._unread_metrics.append(out[-1])
        return out

    async def drain_metrics(self) -> list[dict[str, float]]:
        """Metrics of the rollouts ``run_async`` pushed since the last call (for the trainer's log)."""
        out, self._unread_metrics = self._unread_metrics, []
        return out

    async def stop_async(self) -> None:
        self._stop_async = True

    async def pause(self) -> None:
        await self._m.pause()

    async def resume(self) -> None:
        await self._m.resume()

    async def state_dict(self) -> dict[str, Any]:
        return self._m.state_dict()

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        self._m.load_state_dict(state)

    async def shutdown(self) -> None:
        await self._m.shutdown()

    async def ping(self) -> bool:
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


def creation_setting_error(e: BaseException) -> ValueError | None:
    """The ``ValueError`` (a bad setting; its message names the flag) behind a Ray actor's
    creation error, or None when the actor died of something else."""
    cause = e.__cause__ or getattr(e, "cause", None)
    if isinstance(cause, ValueError):
        return cause
    # Ray 2.60 keeps only the text of an error raised in the actor's __init__: recover the
    # ValueError's message so the caller reports it as a setting error
    messages = [line.split("ValueError: ", 1)[1] for line in str(e).splitlines() if "ValueError: " in line]
    return ValueError(messages[-1]) if messages else None
