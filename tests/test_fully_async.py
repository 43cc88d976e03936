"""slime's fully_async rollout, unchanged (issue 26 item 6): a plugin's own thread and event loop
generate through the rollout manager's loop, the data source holds what such a thread drew across
a checkpoint, a worker that keeps failing ends the step instead of hanging it, and shutdown stops
the worker. ``slime_fixtures/fully_async_rollout.py`` is slime's file, verbatim (the oracle);
``slime.rollout.fully_async_rollout`` is slime_compat's implementation of the same contract."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from _fixtures_rollout import running_manager, toy_argv
from rollout_manager.rollout import RolloutFailed

VERBATIM = "slime_fixtures.fully_async_rollout.generate_rollout_fully_async"
COMPAT = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
INSTANT = ["--rollout-engine", "instant", "--rollout-num-engines", "1", "--health-check-interval", "0.5"]


def _argv(model: Path, *extra: str) -> list[str]:
    # a pool of 2 groups in flight (concurrency 2 x 1 engine), 2 groups a step
    return toy_argv(model, *INSTANT, "--n-samples-per-prompt", "2", "--rollout-batch-size", "2",
                    "--sglang-server-concurrency", "2", "--rollout-max-response-len", "4", *extra)


def _gids(groups) -> list[int]:
    return [g[0].group_index for g in groups]


def _exactly_once(trained: list[int], state: dict) -> None:
    """Every prompt drawn is trained, held by the worker (saved as given back) or back in the
    source: none lost, none twice."""
    held = [g[0]["group_index"] for g in state.get("held_groups", [])]
    source = state["data_source"]
    returned = [g[0]["group_index"] for g in source["returned"]]
    every = trained + held + returned
    assert sorted(every) == list(range(source["next_group_index"])), (trained, held, returned)


@pytest.mark.parametrize("path", [VERBATIM, COMPAT])
def test_three_fully_async_rollouts_draw_each_prompt_once_and_shutdown_stops_the_worker(toy_model_dir, path):
    async def go():
        async with running_manager(_argv(toy_model_dir, "--rollout-function-path", path)) as m:
            trained = []
            for r in range(3):
                groups, metrics = await m.generate(r)
                assert len(groups) == 2 and all(s.status == "completed" and s.weight_versions for g in groups
                                                for s in g)
                trained += _gids(groups)
            assert len(set(trained)) == 6
            deadline = time.monotonic() + 10
            while not m.data_source.num_held and time.monotonic() < deadline:  # the pool refills between steps
                await asyncio.sleep(0.05)
            state = m.state_dict()
            assert state.get("held_groups"), "the worker keeps groups in flight across steps"
            _exactly_once(trained, state)
            t0 = time.monotonic()
        return time.monotonic() - t0  # the context's exit is the shutdown
    took = asyncio.run(go())
    assert took < 10, took
    # slime's worker thread was stopped and joined by its atexit function, run at the shutdown
    assert not [t for t in threading.enumerate() if t.name == "fully-async-rollout" and t.is_alive()]


def _hang_fixture():
    import _fixtures_rollout

    return _fixtures_rollout


def test_a_worker_whose_groups_always_fail_ends_the_step_with_a_clear_error(toy_model_dir):
    """The hang of issue 26: a worker thread drops every group it fails to produce while the
    rollout waits for groups. The failures are counted, and after --rollout-batch-size in a row the
    step ends with RolloutFailed naming the error; the rollout function's thread returns."""
    async def go():
        argv = _argv(toy_model_dir, "--rollout-function-path", "_fixtures_rollout.rollout_whose_worker_fails")
        async with running_manager(argv) as m:
            with pytest.raises(RolloutFailed) as err:
                await asyncio.wait_for(m.generate(0), 30)
            fx = _hang_fixture()
            assert fx.WORKER_STATE["waiting_thread_error"].wait(5), "the rollout function's thread still blocks"
            fx.WORKER_STATE["stop"].set()
            return str(err.value), m.ctx.detached.failures
    message, failures = asyncio.run(go())
    assert "calls in a row that a plugin's own thread handed to the rollout manager failed" in message
    assert "no_such_generate_module" in message and failures["ValueError"] >= 2


def test_held_groups_go_back_to_the_source_on_resume(toy_model_dir):
    """A checkpoint taken while the worker holds groups: the resumed manager serves them first."""
    async def first():
        async with running_manager(_argv(toy_model_dir, "--rollout-function-path", COMPAT)) as m:
            trained = _gids((await m.generate(0))[0])
            return trained, json.loads(json.dumps(m.state_dict()))

    async def resumed(state):
        async with running_manager(_argv(toy_model_dir, "--rollout-function-path", VERBATIM)) as m:
            m.load_state_dict(state)
            held = sorted(g[0]["group_index"] for g in state["held_groups"])
            assert m.data_source.num_returned == len(held)
            trained = []
            for r in (1, 2):
                trained += _gids((await m.generate(r))[0])
            return held, trained, m.state_dict()
    trained0, state = asyncio.run(first())
    held, trained, state2 = asyncio.run(resumed(state))
    assert set(held) <= set(trained) | {g[0]["group_index"] for g in state2.get("held_groups", [])} \
        | {g[0]["group_index"] for g in state2["data_source"]["returned"]}
    _exactly_once(trained0 + trained, state2)
