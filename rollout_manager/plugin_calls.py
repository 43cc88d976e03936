"""Calling the user's plugins without letting them stall the rollout manager.

Every reward, custom generate and filter call goes through ``call_plugin``, which bounds it with
its flag's timeout (``--reward-timeout``, ``--custom-generate-timeout``, ``--filter-timeout``) and
keeps blocking code off the event loop:

- a coroutine function is awaited on the loop and cancelled when its time is up (it must not
  block: blocking work belongs in a plain function);
- a plain function runs in one of the plugin threads (daemon threads: a plugin that never
  returns cannot hold up the process's exit), with the caller's context variables, so the loop,
  and with it the engines' health monitor and every other sample, keeps running while it works.

A call that runs out of time raises ``PluginTimeout``; callers turn it into a counted failure of
that sample or group (``<what>: timeout``). Python cannot stop a thread, so a plain function that
timed out keeps its thread until it returns; the pool has ``_WORKERS`` threads, and when all of
them are held by such calls, new calls wait in the queue and time out in turn: the step goes on
(with failures counted and logged), it never hangs.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import queue
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)
# Threads for plain-function plugins. Enough for rewards that wait on I/O to overlap; CPU-bound
# Python ones share the GIL whatever their number.
_WORKERS = 16


class PluginTimeout(TimeoutError):
    """A plugin call did not return within its flag's timeout."""


class _PluginThreads:
    """A small pool of daemon threads (``concurrent.futures`` joins its workers at exit, so one
    stuck plugin would keep the process from ending)."""

    def __init__(self, workers: int):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = workers
        self._started = 0
        self._busy = 0
        self._lock = threading.Lock()

    @property
    def busy(self) -> int:
        """Threads running a plugin call now (including calls that already timed out)."""
        return self._busy

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.put((fn, fut, loop))
        with self._lock:
            if self._started < self._workers and self._busy + self._queue.qsize() > self._started:
                self._started += 1
                threading.Thread(target=self._work, name=f"plugin-{self._started}", daemon=True).start()
        return fut

    def _work(self) -> None:
        while True:
            fn, fut, loop = self._queue.get()
            if fut.done():  # timed out (cancelled) while queued: nobody waits for it
                continue
            with self._lock:
                self._busy += 1
            try:
                result, error = fn(), None
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                result, error = None, e
            finally:
                with self._lock:
                    self._busy -= 1
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():  # the caller gave up (timeout) meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


_THREADS = _PluginThreads(_WORKERS)


def plugin_threads_busy() -> int:
    """How many plugin threads are running a call now (a stuck plugin holds one)."""
    return _THREADS.busy


async def call_plugin(fn: Callable, *args: Any, timeout: float | None, what: str, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, bounded by ``timeout`` seconds (None: unbounded): awaited if it is a
    coroutine function, else run in a plugin thread (an awaitable it returns is awaited here, within
    the same bound). ``what`` names the plugin in the ``PluginTimeout`` message (its flag and path)."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    if inspect.iscoroutinefunction(fn):
        pending: Any = fn(*args, **kwargs)
    else:
        ctx = contextvars.copy_context()  # the rollout context travels to the thread
        pending = _THREADS.submit(lambda: ctx.run(fn, *args, **kwargs))
    while True:
        try:
            # asyncio.timeout runs a coroutine in this task: wait_for would wrap it in a task of
            # its own, one per reward, hook or filter call (a cost the sample's reward is not)
            async with asyncio.timeout_at(deadline):
                out = await pending
        except TimeoutError:
            if _THREADS.busy >= _WORKERS:
                log.warning("all %d plugin threads are held by calls that did not return", _WORKERS)
            raise PluginTimeout(f"{what} did not return within {timeout:g} s") from None
        if not inspect.isawaitable(out):
            return out
        pending = out  # a plain function that returned an awaitable (e.g. a lambda around an async one)
