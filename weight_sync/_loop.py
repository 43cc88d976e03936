"""A private asyncio loop in a daemon thread, so synchronous trainer code can drive async HTTP.

The trainer calls ``WeightSender`` from plain (non-async) code, possibly inside a process that
already runs its own loop (a Ray actor); a loop of our own in a thread works in both cases.
Blocking work (collectives) runs in daemon threads via ``in_thread`` so that a collective stuck
on a dead peer can be abandoned after a timeout instead of holding interpreter exit.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")


class LoopThread:
    """Runs one event loop forever in a daemon thread; ``run(coro)`` waits for a result."""

    def __init__(self, name: str = "weight-sync-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop; return its result or raise its exception (TimeoutError after
        ``timeout`` seconds, cancelling it)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run called from its own loop (would deadlock)")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    def stop(self) -> None:
        """Cancel what still runs on the loop (e.g. a coroutine given up after a timeout), then stop it."""
        if self.loop.is_closed():
            return

        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_rest(), self.loop).result(timeout=10)
        except Exception as e:  # stopping anyway; say why the leftovers could not be cancelled
            logging.getLogger(__name__).warning("cancelling leftover tasks: %s: %s", type(e).__name__, e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


def in_thread(fn: Callable[..., T], *args: Any) -> "asyncio.Future[T]":
    """Run blocking ``fn(*args)`` in a fresh daemon thread; await its result from the loop."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()
    threading.Thread(target=_call, args=(loop, fut, fn, args), name=f"weight-sync-{getattr(fn, '__name__', 'work')}",
                     daemon=True).start()
    return fut


class SerialThread:
    """One daemon thread that runs blocking calls in the order they were submitted.

    For the collectives of one weight-update group: they must be issued in order, and a thread
    kept for the group saves starting one per bucket, a cost that counts on a push of a few ms.
    A daemon thread, so a call stuck on a dead peer can be abandoned (see ``in_thread``).
    """

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., T], *args: Any) -> "asyncio.Future[T]":
        """Queue ``fn(*args)``; await its result from the (running) loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._queue.put((loop, fut, fn, args))
        return fut

    def stop(self) -> None:
        """The thread ends once the calls queued before this one are done."""
        self._queue.put(None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            _call(*item)


def _call(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, fn: Callable[..., Any], args: tuple) -> None:
    """Run ``fn(*args)`` here and hand the result (or exception) to ``fut`` on ``loop``."""
    try:
        out, ok = fn(*args), True
    except BaseException as e:  # handed to the awaiting coroutine, which raises it
        out, ok = e, False
    if not loop.is_closed():
        loop.call_soon_threadsafe(_deliver, fut, ok, out)


def _deliver(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if fut.done():  # the waiter gave up (timeout); the late result has no one to go to
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)
