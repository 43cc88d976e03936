"""Async mode's producer: the rollout loop, driven from a thread of the driver.

Rollout ``r`` starts once the buffer's weight version is >= ``r - K`` (``--max-weight-staleness``),
so the producer never runs further ahead than the bound allows. After each rollout's put it
notes the rollout manager's data position, so that a checkpoint can record a data position that
matches exactly the puts the buffer holds (``position_after``): on resume, the rollouts after
that point are generated again from it, under the same put ids, and nothing is drawn twice or
skipped.
"""

from __future__ import annotations

import threading
from typing import Any

from buffer.ray_errors import error_line
from buffer.retry import call_buffer

_VERSION_POLL_S = 1.0  # how long one wait for the weight version lasts before looking at stop()


class AsyncProducer:
    """Produces rollouts ``start .. end-1`` into the buffer until done or ``stop``."""

    def __init__(self, rollout: Any, buffer: Any, start: int, end: int, max_staleness: int):
        import ray

        self._rollout, self._buffer = rollout, buffer
        self._start, self._end, self._k = start, end, max_staleness
        self._positions = {start: ray.get(rollout.state_dict.remote())}  # rollout id -> data position before it
        self._metrics: list[dict[str, float]] = []
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="reservoir-async-producer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        try:
            for r in range(self._start, self._end):
                while not self._stop.is_set() and \
                        call_buffer(self._buffer, "wait_weight_version", r - self._k, _VERSION_POLL_S) < r - self._k:
                    pass
                if self._stop.is_set():
                    return
                metrics = ray.get(self._rollout.push.remote(r, self._buffer))
                position = ray.get(self._rollout.state_dict.remote())
                with self._cond:
                    self._positions[r + 1] = position
                    self._metrics.append(metrics)
                    self._cond.notify_all()
        except BaseException as e:  # surfaced to the driver by check() / position_after()
            with self._cond:
                self._error = e if not self._stop.is_set() else None
                self._cond.notify_all()
        finally:
            with self._cond:
                self._cond.notify_all()

    def position_after(self, last_put: int) -> dict[str, Any]:
        """The rollout manager's data position right after rollout ``last_put`` was put (before
        ``last_put + 1`` drew anything). Waits for the producer to note it."""
        want = last_put + 1
        with self._cond:
            self._cond.wait_for(lambda: want in self._positions or self._error is not None
                                or not self._thread.is_alive())
            if want not in self._positions:
                self.check()
                raise RuntimeError(f"async producer stopped before rollout {last_put} was put")
            for r in [r for r in self._positions if r < want]:
                del self._positions[r]
            return self._positions[want]

    def check(self) -> None:
        """Raise the producer's error, if it failed."""
        if self._error is not None:
            raise RuntimeError(f"async rollout producer failed: {error_line(self._error)}") from self._error

    def drain_metrics(self) -> list[dict[str, float]]:
        """Metrics of the rollouts put since the last call."""
        with self._cond:
            out, self._metrics = self._metrics, []
        return out

    def stop(self, timeout_s: float) -> None:
        """Stop after the rollout in progress (waits at most ``timeout_s`` for it)."""
        self._stop.set()
        self._thread.join(timeout_s)
