"""The buffer as an async Ray actor: a thin wrapper that adds waiting around ``BufferCore``.

Every method runs on the actor's one event loop, so the core is never touched concurrently;
one ``asyncio.Condition`` wakes waiting puts (room) and gets (eligible groups). Create it with
``buffer.create_buffer`` (which sets the restart policy), find it with ``buffer.get_buffer``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import time
from pathlib import Path

import ray

from buffer.core import BufferCore
from buffer.settings import BufferSettings, load_filter
from buffer.sample import Sample
from buffer.store import SegmentStore, read_generation, write_generation


@ray.remote
class BufferActor:
    """The data buffer (see ``buffer.interfaces`` for the protocol). All methods are async."""

    def __init__(self, settings: BufferSettings, plugin_args: argparse.Namespace | None = None) -> None:
        self._settings = settings
        store = None
        if settings.persist_dir is not None:
            store = SegmentStore(settings.persist_dir, fsync=settings.fsync, segment_bytes=settings.segment_bytes)
        self._core = BufferCore(settings, load_filter(settings), plugin_args, store)
        if store is not None:
            self._core.recover(*store.load())  # a restart after a crash resumes from here
        self._cond = asyncio.Condition()

    async def ping(self) -> int:
        """The actor's process id (tests use it to SIGKILL the process)."""
        return os.getpid()

    async def put(self, groups: list[list[Sample]], put_id: str | None = None,
                  timeout_s: float | None = None) -> int:
        """Store groups; returns how many were accepted. Waits while the buffer is full.

        Validated first (``ValueError`` naming the group and field; nothing is stored). A retry
        with the same ``put_id`` returns the first call's count without storing again. With
        ``--buffer-dir`` the groups are on disk when this returns.
        """
        prior = self._core.duplicate(put_id)
        if prior is not None:
            return prior
        self._core.validate_put(groups, put_id)
        timeout = self._settings.put_timeout_s if timeout_s is None else timeout_s
        async with self._cond:
            t0, m = time.monotonic(), self._core.metrics
            m.waiting_puts += 1
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self._core.has_room(len(groups))), timeout)
            except TimeoutError:
                raise TimeoutError(
                    f"put of {len(groups)} groups waited {timeout:g}s for room: the buffer holds "
                    f"{self._core.size()} of --buffer-capacity {self._settings.capacity} groups "
                    "(is the trainer consuming? raise --buffer-capacity or --buffer-put-timeout)") from None
            finally:
                m.waiting_puts -= 1
                m.put_wait_s += time.monotonic() - t0
            prior = self._core.duplicate(put_id)  # the same put_id may have been stored meanwhile
            if prior is not None:
                return prior
            n = self._core.put(groups, put_id)
            self._cond.notify_all()
        return n

    async def get(self, num_groups: int, timeout_s: float | None = None,
                  step: int | None = None) -> list[list[Sample]]:
        """Wait until ``num_groups`` eligible groups exist and take them (FIFO, or the filter's pick).

        ``step`` leases them to that training step until ``commit(step)``; ``rewind`` can give
        them back; asking again for the same step (a retry) returns the same batch. Without
        ``step`` they are consumed for good. On timeout: ``TimeoutError`` (nothing taken).
        """
        self._core.check_get(num_groups)
        timeout = self._settings.get_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self._cond:
            t0, m, waiting = time.monotonic(), self._core.metrics, 0
            try:
                while True:
                    groups = self._core.try_get(num_groups, step)
                    if groups is not None:
                        self._cond.notify_all()  # room for waiting puts
                        return groups
                    m.waiting_gets += 1 - waiting  # counted once, however often it wakes
                    waiting = 1
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        hint = " (the --buffer-filter-path picked fewer)" if self._settings.filter_path else ""
                        raise TimeoutError(f"get of {num_groups} groups timed out after {timeout:g}s: "
                                           f"{self._core.size()} eligible groups available{hint}")
                    try:
                        await asyncio.wait_for(self._cond.wait(), remaining)
                    except TimeoutError:
                        pass  # look once more, then fail above
            finally:
                m.waiting_gets -= waiting
                m.get_wait_s += time.monotonic() - t0

    async def set_weight_version(self, v: int) -> None:
        """The policy's current weight version (groups beyond the staleness bound are pruned)."""
        async with self._cond:
            self._core.set_version(v)
            self._cond.notify_all()

    async def get_weight_version(self) -> int:
        return self._core.version

    async def wait_weight_version(self, v: int, timeout_s: float) -> int:
        """Wait (at most ``timeout_s``) until the weight version is >= ``v``; returns the version
        then (lower than ``v`` on timeout). Producers use it to stay within the staleness bound."""
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self._core.version >= v), timeout_s)
            except TimeoutError:
                pass
            return self._core.version

    async def known_put_ids(self) -> list[str]:
        """The put ids a retried put would be recognised by, oldest first."""
        return self._core.known_put_ids()

    async def take_returned(self, max_groups: int, request_id: str | None = None) -> list[list[Sample]]:
        """Stale groups set aside for regeneration (``--stale-policy return``), for good; a retry
        with the same ``request_id`` gets the same groups (``BufferCore.take_returned``)."""
        async with self._cond:
            return self._core.take_returned(max_groups, request_id)

    async def returns_groups(self) -> bool:
        """Whether ``take_returned`` may ever hand out a group (``BufferCore.returns_groups``):
        a producer that hears False once calls it no more."""
        async with self._cond:
            return self._core.returns_groups()

    async def commit(self, step: int, covered_put_ids: list[str] | None = None, cover_known: bool = False,
                     return_metrics: bool = False) -> dict[str, float | int | dict] | None:
        """The trainer's checkpoint of ``step`` is durable: consumption by steps <= step is final,
        and so are the returned groups taken by the puts it covers (``BufferCore.commit``;
        ``cover_known``: every put id it knows). ``return_metrics``: returns ``metrics()`` as they
        are after the commit (a launcher that logs them right after saves a round trip)."""
        async with self._cond:
            self._core.commit(step, covered_put_ids, cover_known)
            return self._core.as_metrics() if return_metrics else None

    async def rewind(self, step: int, weight_version: int | None = None,
                     forget_put_ids: list[str] | None = None) -> int:
        """Resume from the checkpoint of ``step``: groups of later steps go back to the front; the
        version goes back to the checkpoint's ``weight_version``; the groups of ``forget_put_ids``
        (puts the checkpoint does not cover) are dropped and their ids forgotten
        (``BufferCore.rewind``). Idempotent."""
        async with self._cond:
            n = self._core.rewind(step, weight_version, forget_put_ids)
            self._cond.notify_all()
            return n

    async def size(self) -> int:
        """Groups waiting in the queue (eligible for get)."""
        return self._core.size()

    async def metrics(self) -> dict[str, float | int | dict]:
        """Size, puts/gets, rejects by field, drops by reason, staleness histogram, bytes on disk."""
        return self._core.as_metrics()

    async def save(self, path: str) -> None:
        """Write the whole state (queued, leased, returned groups; version) to directory ``path``."""
        async with self._cond:
            target = Path(path)
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            write_generation(tmp, self._core, fsync=True)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)

    async def restore(self, path: str) -> None:
        """Replace the whole state by what ``save(path)`` wrote (persisted first, if persistent)."""
        directory = Path(path)
        if not (directory / "log.jsonl").exists():
            raise ValueError(f"restore: {path!r} is not a buffer snapshot written by save() (no log.jsonl)")
        async with self._cond:
            self._core.replace_with(*read_generation(directory))
            self._cond.notify_all()
