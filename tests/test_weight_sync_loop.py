"""The sender's private event loop, daemon-thread offloading, and the bounded gather of a bucket."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from weight_sync._loop import LoopThread, in_thread
from weight_sync.link import _gather_bounded


def test_loop_thread_runs_coroutines_and_raises_their_errors():
    lt = LoopThread()
    try:
        async def add(a, b):
            await asyncio.sleep(0.01)
            return a + b

        assert lt.run(add(1, 2), timeout=5) == 3

        async def boom():
            raise ValueError("bad")

        with pytest.raises(ValueError, match="bad"):
            lt.run(boom(), timeout=5)
        with pytest.raises(TimeoutError):
            lt.run(asyncio.sleep(10), timeout=0.1)
    finally:
        lt.stop()


def test_in_thread_result_error_and_abandon_after_timeout():
    release = threading.Event()

    async def main():
        assert await in_thread(lambda x: x * 2, 21) == 42
        with pytest.raises(KeyError):
            await in_thread(lambda: {}["k"])
        stuck = in_thread(release.wait, 30)  # a collective stuck on a dead peer
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(stuck, 0.1)
        release.set()  # its late result goes nowhere, without an error
        await asyncio.sleep(0.05)

    asyncio.run(main())


def test_gather_bounded_gives_the_rest_a_grace_period_after_a_failure():
    calls = []

    async def fail():
        raise RuntimeError("peer died")

    async def slow():
        await asyncio.sleep(30)

    async def ok():
        return "fine"

    async def on_failure():
        calls.append(1)

    async def main():
        t = time.monotonic()
        outs = await _gather_bounded([fail(), slow(), ok()], timeout_s=60, on_failure=on_failure, grace_s=0.2)
        return outs, time.monotonic() - t

    outs, elapsed = asyncio.run(main())
    assert isinstance(outs[0], RuntimeError) and isinstance(outs[1], TimeoutError) and outs[2] == "fine"
    assert calls == [1] and elapsed < 5


def test_gather_bounded_all_ok_waits_for_everything():
    async def v(x, d):
        await asyncio.sleep(d)
        return x

    assert asyncio.run(_gather_bounded([v(1, 0.05), v(2, 0.01)], timeout_s=5)) == [1, 2]
