"""``slime.rollout.fully_async_rollout``: slime's fully-async rollout, on the rollout manager's loop.

``--rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async`` keeps a
pool of groups generating across rollout steps (``--sglang-server-concurrency`` x engines of them,
each through ``generate_and_rm_group``, so ``--custom-generate-function-path`` and
``--custom-rm-path`` apply), and each step takes ``--rollout-batch-size`` finished groups, ordered
by sample index; the rest stay queued for the next step. At most as many finished groups wait as
groups generate (the pool stops drawing prompts while that many wait). A group that comes back
aborted goes back to the data source instead of to training, as in slime.

slime runs the pool in a worker thread with an event loop of its own; here each group is detached
work on the manager's loop (``plugin_api.start_detached``): it draws its prompt there, so the
data source holds it for the checkpoint until the group is trained (no prompt lost or drawn twice
across a resume), a group that fails is given back to the data source and counted (after
``--rollout-batch-size`` failures in a row the step ends with ``RolloutFailed``), and the manager's
shutdown aborts and ends the pool. slime's own file, run unchanged, behaves the same way through
the same plugin API (docs/slime.md).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

from buffer.sample import Sample, Status
from rollout_manager.plugin_api import current_context, on_shutdown, start_detached
from slime_compat.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime_compat.utils.async_utils import run
from slime_compat.utils.http_utils import get_rollout_num_engines

__all__ = ["AsyncRolloutWorker", "generate_rollout_fully_async"]
log = logging.getLogger(__name__)
_RETRY_AFTER_FAILURE_S = 1.0  # a group failed: draw the next one after this pause (as slime's poll)
_WORKERS: dict[int, "AsyncRolloutWorker"] = {}  # one per rollout manager context


class AsyncRolloutWorker:
    """The pool of groups in flight and the queue of finished ones (see the module doc). Lives on
    the rollout manager's loop; build it there."""

    def __init__(self, args: Any, data_buffer: Any, concurrency: int = 10):
        self.args, self.data_buffer, self.concurrency = args, data_buffer, max(1, concurrency)
        self.state = GenerateState(args)
        self.completed: collections.deque[tuple[int, list[Sample]]] = collections.deque()
        self.arrived = asyncio.Event()  # a group finished, failed or went back
        self.in_flight = 0
        self.dry = False  # the data source had no prompt for the last draw
        self.running = True
        self._next_gid = 0

    def start(self) -> None:
        """Fill the pool (again): up to ``concurrency`` groups in flight while fewer finished ones wait."""
        self.dry = False
        self._top_up()

    def stop(self) -> None:
        """Draw no more prompts (what runs ends at the manager's shutdown)."""
        self.running = False

    def queue_size(self) -> int:
        """Finished groups waiting for a rollout step."""
        return len(self.completed)

    def get_completed_groups(self, limit: int | None = None) -> list[tuple[int, list[Sample]]]:
        """Take up to ``limit`` finished groups (all when None), oldest first."""
        out = []
        while self.completed and (limit is None or len(out) < limit):
            out.append(self.completed.popleft())
        return out

    def _top_up(self) -> None:
        ctx = current_context()
        while (self.running and not self.dry and not ctx.detached.closed and self.in_flight < self.concurrency
               and len(self.completed) < self.concurrency):
            self.in_flight += 1
            gid, self._next_gid = self._next_gid, self._next_gid + 1
            task = start_detached(self._one(gid))
            task.add_done_callback(self._landed)

    async def _one(self, gid: int) -> None:
        groups = self.data_buffer.get_samples(1)  # drawn as detached work: held until trained
        if not groups:
            self.dry = True
            return
        group = groups[0]
        try:
            result = await generate_and_rm_group(self.args, group, sampling_params=self.state.sampling_params.copy(),
                                                 evaluation=False)
        except Exception:
            self.data_buffer.add_samples([group])  # never lose the prompt; the failure is counted
            raise
        flat = [x for part in result for x in (part if isinstance(part, list) else [part])]
        if any(x.status == Status.ABORTED for x in flat):
            self.data_buffer.add_samples([result])  # generated again next time (slime's requeue)
        else:
            self.completed.append((gid, result))

    def _landed(self, task: asyncio.Future) -> None:
        self.in_flight -= 1
        self.arrived.set()
        if task.cancelled():
            return
        if task.exception() is not None:  # counted and logged by the manager (DetachedWork)
            asyncio.get_running_loop().call_later(_RETRY_AFTER_FAILURE_S, self._top_up_if_running)
            return
        self._top_up_if_running()

    def _top_up_if_running(self) -> None:
        if self.running and current_context(None) is not None:
            self._top_up()


def _worker(args: Any, data_buffer: Any) -> AsyncRolloutWorker:
    ctx = current_context()
    worker = _WORKERS.get(id(ctx))
    if worker is None or worker.data_buffer is not data_buffer:
        concurrency = args.sglang_server_concurrency * get_rollout_num_engines(args)
        worker = _WORKERS[id(ctx)] = AsyncRolloutWorker(args, data_buffer, concurrency)
    return worker


@on_shutdown
def _forget_workers() -> None:
    """The manager shut down (its detached work is over): no worker outlives it."""
    for worker in _WORKERS.values():
        worker.stop()
    _WORKERS.clear()


async def _collect(args: Any, rollout_id: int, data_buffer: Any) -> list[list[Sample]]:
    worker = _worker(args, data_buffer)
    target = args.rollout_batch_size
    taken: list[list[Sample]] = []
    worker.start()
    while len(taken) < target:
        taken += [g for _, g in worker.get_completed_groups(target - len(taken))]
        if len(taken) >= target:
            break
        worker.start()
        if worker.dry and not worker.in_flight:
            log.warning("fully-async rollout %d: the data source ran out with %d/%d groups", rollout_id, len(taken),
                        target)
            break
        worker.arrived.clear()
        await worker.arrived.wait()
    first_index = lambda g: next((int(x.index) for x in g if getattr(x, "index", None) is not None), 0)  # noqa: E731
    return sorted(taken, key=first_index)


def generate_rollout_fully_async(args: Any, rollout_id: int, data_buffer: Any,
                                 evaluation: bool = False) -> list[list[Sample]]:
    """slime's ``--rollout-function-path`` entry point (blocking, as slime's): this step's groups."""
    if evaluation:
        raise ValueError("fully-async rollout doesn't support evaluation mode")
    return run(_collect(args, rollout_id, data_buffer))
