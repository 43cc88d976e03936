"""``slime.utils.async_utils``: ``run(coro)`` runs a coroutine on the rollout manager's event loop.

slime runs its rollout coroutines on one background loop; a blocking rollout function calls
``run(generate_rollout_async(...))``. Reservoir calls blocking rollout functions from a worker
thread, so ``run`` hands the coroutine to the manager's loop (where the router client, the
concurrency limit and the engines' state live) with the rollout context and step attached, and
waits for it. Outside a rollout (a script of your own), it runs the coroutine with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine

from rollout_manager.plugin_api import current_context, current_step, set_context, set_step


def run(coro: Coroutine) -> Any:
    ctx, step = current_context(None), current_step(None)
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

    async def with_context() -> Any:
        set_context(ctx)
        if step is not None:
            set_step(step)
        return await coro
    return asyncio.run_coroutine_threadsafe(with_context(), ctx.loop).result()
