"""A reward plugin that blocks cannot stall the rollout manager (issue 16, item 4): it runs in a
plugin thread, the engines' health monitor keeps running meanwhile, and the call ends at
--reward-timeout as a counted failure. Real manager, router and embedded engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from _fixtures_rollout import running_manager, toy_argv
from rollout_manager.rollout import RolloutFailed

pytest.importorskip("sglang_router")
ENTERED = threading.Event()
RELEASE = threading.Event()


def blocking_rm(args, sample) -> float:
    """Blocks its thread (a stand-in for a hung remote call or a stuck verifier)."""
    ENTERED.set()
    RELEASE.wait(120)
    return 1.0


def test_blocking_reward_times_out_while_the_health_monitor_keeps_running(toy_model_dir):
    argv = toy_argv(toy_model_dir, "--custom-rm-path", "test_reliability_engine_plugins.blocking_rm",
                    "--reward-timeout", "1", "--health-check-interval", "0.1", "--rollout-batch-size", "2",
                    "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4")

    async def go():
        async with running_manager(argv) as m:
            step = asyncio.ensure_future(m.generate(0))
            while not ENTERED.is_set():
                await asyncio.sleep(0.02)
            rounds = m.fleet.rounds
            while m.fleet.rounds < rounds + 3:  # the loop runs monitor rounds while the reward blocks
                await asyncio.sleep(0.02)
            blocked_meanwhile = not RELEASE.is_set() and not step.done()
            with pytest.raises(RolloutFailed) as failed:  # every sample's reward timed out: no group kept
                await asyncio.wait_for(step, 120)
            return blocked_meanwhile, failed.value
    try:
        blocked_meanwhile, failed = asyncio.run(go())
    finally:
        RELEASE.set()
    assert blocked_meanwhile
    assert failed.step.stats.failures["reward: timeout"] >= 4 and "reward: timeout" in str(failed)
