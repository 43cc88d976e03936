"""Where the default generate sends a request: through the router, or straight to an engine.

``--rollout-dispatch router`` (the default, slime's way): every request goes to sglang-router,
which balances the engines. ``--rollout-dispatch direct``: the manager itself sends each request
to the live engine with the fewest samples in flight, skipping engines that just failed this
sample; this saves the router hop (CPU per request that weighs on short generations on a small
CPU box: bench/NOTES.md, rollout) and sends a retry to a different engine at once. The
router still runs either way: custom generate functions and outside tools use it.
"""

from __future__ import annotations

from typing import Callable

from sglang_protocol.client import EngineClient, new_session


class Dispatcher:
    """Picks the client for one request; counts samples in flight per engine (direct mode)."""

    def __init__(self, router: EngineClient, live_urls: Callable[[], list[str]], direct: bool,
                 timeout: float | None, api_key: str | None = None, admin_api_key: str | None = None):
        """``api_key`` / ``admin_api_key``: the engines' keys (``EngineFleetSettings``), sent by the
        clients of direct mode."""
        self.router, self.live_urls, self.direct, self.timeout = router, live_urls, direct, timeout
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self._session = new_session() if direct else None
        self._clients: dict[str, EngineClient] = {}
        self.inflight: dict[str, int] = {}

    def pick(self, avoid: set[str]) -> tuple[str, EngineClient]:
        """(url, client) for the next request; ``avoid``: engines that failed this sample."""
        if not self.direct:
            return self.router.base_url, self.router
        live = self.live_urls()
        candidates = [u for u in live if u not in avoid] or live
        if not candidates:  # every engine is down right now: the router answers 503, the caller backs off
            return self.router.base_url, self.router
        url = min(candidates, key=lambda u: self.inflight.get(u, 0))
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = EngineClient(url, timeout=self.timeout, session=self._session,
                                                       api_key=self.api_key, admin_api_key=self.admin_api_key)
        return url, client

    def started(self, url: str, samples: int = 1) -> None:
        """A request of ``samples`` samples (a group request carries several) went to ``url``."""
        self.inflight[url] = self.inflight.get(url, 0) + samples

    def finished(self, url: str, samples: int = 1) -> None:
        self.inflight[url] -= samples

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
