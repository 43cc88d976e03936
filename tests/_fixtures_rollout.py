"""Helpers shared by the rollout manager's tests (tests/test_rollout_*.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from pathlib import Path
from typing import AsyncIterator

from rollout_manager.arguments import add_arguments, settings_from_args, split_sglang_args
from rollout_manager.manager import RolloutManager
from rollout_manager.settings import RolloutSettings


def make_args(argv: list[str]) -> tuple[argparse.Namespace, RolloutSettings]:
    """Parse ``argv`` with the rollout manager's own flags, as the launcher and the CLI do."""
    ours, sglang = split_sglang_args(argv)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(ours)
    return args, settings_from_args(args, sglang)


def toy_argv(model: Path, *extra: str) -> list[str]:
    """The toy task with the chat template and the toy checker; ``extra`` adds or overrides flags."""
    return ["--hf-checkpoint", str(model), "--prompt-data", str(model / "data" / "train.jsonl"),
            "--apply-chat-template", "--rm-type", "toy_arithmetic", *extra]


@contextlib.asynccontextmanager
async def running_manager(argv: list[str], log_dir: str | None = None) -> AsyncIterator[RolloutManager]:
    """A started RolloutManager (router + engines), shut down afterwards whatever happens."""
    args, settings = make_args(argv)
    manager = RolloutManager(settings, args, log_dir=log_dir)
    await manager.start()
    try:
        yield manager
    finally:
        await manager.shutdown()


# --- plugins used by the tests (importable as _fixtures_rollout.<name>) -------------------------
async def parity_rm(args, sample) -> float:
    """Even groups get mixed rewards (1 for even sample indices), odd groups all zeros."""
    return 1.0 if sample.group_index % 2 == 0 and sample.index % 2 == 0 else 0.0


def wrapped_rollout(args, rollout_id, data_source, evaluation=False):
    """A slime-style (blocking) rollout function that reuses the default one and tags its groups."""
    from rollout_manager.rollout import generate_rollout

    groups = generate_rollout(args, rollout_id, data_source, evaluation)
    for g in groups:
        for s in g:
            s.metadata["wrapped"] = rollout_id
    return groups


async def wait_inflight(manager: RolloutManager, n: int, settle: float = 0.15, timeout: float = 30.0) -> None:
    """Wait until ``n`` requests hold the manager's concurrency slots (sent or about to be), then
    ``settle`` seconds for them to reach the engines: fault tests act mid-request, not by luck."""
    import asyncio
    import time

    sem = manager.ctx.semaphore
    total = manager.settings.sampling.sglang_server_concurrency * len(manager.engine_urls)
    deadline = time.monotonic() + timeout
    while total - sem._value < n:  # asyncio.Semaphore has no public counter
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {total - sem._value}/{n} requests in flight after {timeout}s")
        await asyncio.sleep(0.01)
    await asyncio.sleep(settle)


async def push_during_pause(manager: RolloutManager, version: str = "1") -> None:
    """What the trainer's push does to the rollout: pause the manager (partial rollout aborts what is
    in flight), move every engine to weight version ``version`` (no weights on disk: the engines
    used here only take the version), resume."""
    from sglang_protocol.client import EngineClient

    await manager.pause()
    for url in manager.engine_urls:
        async with EngineClient(url, timeout=10) as c:
            await c.update_weights_from_disk("unused", weight_version=version)
    await manager.resume()


async def half_broken_generate(args, sample, sampling_params):
    """A custom generate that leaves odd samples half-written and raises (a plugin bug)."""
    from rollout_manager.generate import generate

    if sample.index % 2:
        sample.tokens.append(10)
        sample.response_length += 1  # but no loss_mask entry: inconsistent
        raise RuntimeError("tool crashed")
    return await generate(args, sample, sampling_params)


# the fully_async hang of issue 26 (tests/test_fully_async.py): a worker thread with a loop of its own
WORKER_STATE: dict = {}


def rollout_whose_worker_fails(args, rollout_id, data_source, evaluation=False):
    """Starts a worker thread (its own event loop) whose every group fails before generating (a
    generate path that does not import) and drops it, then waits for groups on the manager's loop,
    as slime's fully_async does: without the manager's guard it would wait forever."""
    import threading

    from slime.rollout.sglang_rollout import generate_and_rm_group
    from slime.utils.async_utils import run

    stop = WORKER_STATE["stop"] = threading.Event()
    WORKER_STATE["waiting_thread_error"] = threading.Event()

    async def work():
        while not stop.is_set():
            for group in data_source.get_samples(1):
                for s in group:
                    s.generate_function_path = "no_such_generate_module.generate"
                try:
                    await generate_and_rm_group(args, group, {}, evaluation=False)
                except Exception:
                    pass  # dropped, as slime's worker drops a group whose task raised
            await asyncio.sleep(0.05)
    threading.Thread(target=lambda: asyncio.run(work()), daemon=True).start()

    async def wait_forever():
        await asyncio.Event().wait()
    try:
        return run(wait_forever())
    except RuntimeError:
        WORKER_STATE["waiting_thread_error"].set()
        raise
