"""The embedded engine inside a Ray actor: the same HTTP server, hosted by the actor process.

    handle, url = start_engine_actor(EngineSettings(model_path=..., port=0), num_cpus=1)
    ...  # talk to url with EngineClient, put it behind the router
    ray.get(handle.shutdown.remote()); ray.kill(handle)

The server runs on its own event loop thread inside the actor, so the actor's methods
(``url``, ``load``, ``shutdown``) stay callable while requests are served.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

from sglang_protocol.net import free_port
from .settings import EngineSettings


class EngineActor:
    """Hosts one engine server (use through ``start_engine_actor``, which wraps it with ray.remote)."""

    def __init__(self, settings: EngineSettings, start_timeout_s: float = 600.0):
        from .server import start_server

        if settings.port == 0:
            settings = dataclasses.replace(settings, port=free_port(settings.host))
        self.settings = settings
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-http", daemon=True)
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(start_server(settings), self._loop)
        self._runner, self._engine = fut.result(start_timeout_s)

    def url(self) -> str:
        return self.settings.url

    def load(self) -> dict:
        return self._engine.scheduler.load()

    def weight_version(self) -> str:
        return self._engine.scheduler.weight_version

    def shutdown(self) -> None:
        """Stop serving and free the model; the actor can then be killed."""
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._engine.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def start_engine_actor(settings: EngineSettings, **ray_options: Any) -> tuple[Any, str]:
    """Create an EngineActor (``ray_options`` go to ``.options()``, e.g. num_cpus, num_gpus,
    scheduling_strategy) and wait until it serves. Returns (actor handle, url)."""
    import ray

    handle = ray.remote(EngineActor).options(**ray_options).remote(settings)
    url = ray.get(handle.url.remote())
    return handle, url
