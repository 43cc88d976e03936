"""``slime.utils.async_utils``: ``run(coro)`` runs a coroutine on the rollout manager's event loop.

slime runs its rollout coroutines on one background loop; a blocking rollout function calls
``run(generate_rollout_async(...))``. Reservoir calls blocking rollout functions from a worker
thread, so ``run`` hands the coroutine to the manager's loop (where the router client, the
concurrency limit and the engines' state live) with the rollout context and step attached, and
waits for it (``plugin_api.call_on_manager_loop``); from a thread of the plugin's own it does the
same, as work of no rollout step. Outside a rollout (a script of your own, no rollout manager in
the process), it runs the coroutine with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine

from rollout_manager.plugin_api import call_on_manager_loop, current_context


def run(coro: Coroutine) -> Any:
    """Run ``coro`` to its end on the rollout manager's loop and return its result (blocking)."""
    ctx = current_context(None)
    if ctx is None:
        return asyncio.run(coro)
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is ctx.loop:
        coro.close()
        raise RuntimeError("slime.utils.async_utils.run blocks: it was called on the rollout manager's event "
                           "loop (from async code, await the coroutine instead)")
    return call_on_manager_loop(coro)
