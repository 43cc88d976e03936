"""Calling the buffer across its restart window: the one home of that retry.

With ``--buffer-dir`` the buffer actor restarts after a crash (SIGKILL included) and recovers
its state from disk. While it is down, calls fail with Ray's actor errors
(``ActorDiedError`` for a call in flight when it died, ``ActorUnavailableError`` while it
restarts); Ray itself never retries them (``max_task_retries=0``, see ``buffer.interfaces``).
``call_buffer`` retries such a call a bounded number of times. Only idempotent calls may go
through it: ``put`` with a ``put_id``, ``get`` with a ``step`` (a retry gets the same batch),
``commit``, ``rewind``, ``set_weight_version``, and the read-only ones. Any other error (a bad
argument, a ``TimeoutError`` from the buffer) is raised at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Iterator

log = logging.getLogger(__name__)

RETRY_WINDOW_S = 120.0  # how long a call keeps retrying: the buffer's recovery from disk fits well inside
_FIRST_DELAY_S, _MAX_DELAY_S = 0.25, 5.0


class BufferUnavailable(RuntimeError):
    """The buffer did not come back within the retry window."""


def _retryable() -> tuple[type[BaseException], ...]:
    import ray

    # RayActorError covers ActorDiedError and ActorUnavailableError
    return (ray.exceptions.RayActorError,)


def _delays(window_s: float) -> Iterator[float]:
    """Back-off delays, doubling up to a cap, until ``window_s`` is spent."""
    deadline, delay = time.monotonic() + window_s, _FIRST_DELAY_S
    while (left := deadline - time.monotonic()) > 0:
        yield min(delay, left)
        delay = min(2 * delay, _MAX_DELAY_S)


def _next_delay(delays: Iterator[float], method: str, attempts: int, window_s: float, err: BaseException) -> float:
    """The wait before the next attempt (logged), or ``BufferUnavailable`` once the window is spent."""
    delay = next(delays, None)
    if delay is None:
        raise BufferUnavailable(f"buffer.{method}: the buffer actor did not answer after {attempts} attempts over "
                                f"{window_s:g}s (is --buffer-dir set? without it the buffer is not restarted): "
                                f"{err}") from err
    log.warning("buffer.%s failed (%s: the buffer actor is restarting?); retry %d in %.2fs",
                method, type(err).__name__, attempts, delay)
    return delay


def call_buffer(handle: Any, method: str, *args: Any, window_s: float = RETRY_WINDOW_S,
                ray_timeout_s: float | None = None, **kwargs: Any) -> Any:
    """``ray.get(handle.<method>.remote(*args, **kwargs))``, retried while the buffer restarts.

    For synchronous callers (the driver, a trainer rank); ``ray_timeout_s`` bounds each attempt's
    wait (``ray.get``'s timeout), the retries stop after ``window_s``.
    """
    import ray

    attempts, delays = 0, _delays(window_s)
    while True:
        attempts += 1
        try:
            return ray.get(getattr(handle, method).remote(*args, **kwargs), timeout=ray_timeout_s)
        except _retryable() as e:
            time.sleep(_next_delay(delays, method, attempts, window_s, e))


async def call_buffer_async(handle: Any, method: str, *args: Any, window_s: float = RETRY_WINDOW_S,
                            **kwargs: Any) -> Any:
    """``await handle.<method>.remote(...)`` with the same retries, for callers on an event loop."""
    attempts, delays = 0, _delays(window_s)
    while True:
        attempts += 1
        try:
            return await getattr(handle, method).remote(*args, **kwargs)
        except _retryable() as e:
            await asyncio.sleep(_next_delay(delays, method, attempts, window_s, e))


class BufferVersionSink:
    """A weight-version sink (``weight_sync.interfaces.VersionSink``) that records each pushed
    version in the buffer actor with ``set_weight_version``, retried across the buffer's restart.

    Picklable (an actor handle and a float), so it travels to the trainer rank that pushes."""

    def __init__(self, handle: Any, ray_timeout_s: float | None = None):
        self.handle, self.ray_timeout_s = handle, ray_timeout_s

    def __call__(self, version: int) -> None:
        call_buffer(self.handle, "set_weight_version", version, ray_timeout_s=self.ray_timeout_s)


class PendingGet:
    """A ``get(n, step=step)`` already sent to the buffer, whose groups are fetched where they are
    used: the driver hands it to trainer rank 0, so the batch goes from the object store to the
    rank without the driver unpickling and pickling it again. Picklable (an actor handle, the
    call's ``ObjectRef`` and its arguments).

    :meth:`result` waits for the answer; a call that failed because the buffer was restarting is
    asked again through :func:`call_buffer` (``get`` with a ``step`` is idempotent: the same batch)."""

    def __init__(self, handle: Any, n: int, step: int):
        self.handle, self.n, self.step = handle, n, step
        self.ref = handle.get.remote(n, step=step)

    def result(self) -> Any:
        """The groups (``ray.get``); the buffer's own error when the get failed."""
        import ray

        try:
            return ray.get(self.ref)
        except _retryable():
            return call_buffer(self.handle, "get", self.n, step=self.step)
