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


# CI time: one launcher run (slime's file); slime_compat's runs the same in-process test above
@pytest.mark.parametrize("path", [VERBATIM, pytest.param(COMPAT, marks=pytest.mark.slow)])
def test_three_fully_async_steps_through_the_launcher(toy_model_dir, tmp_path, path):
    """scripts/train.py, async mode (--max-weight-staleness 1, stale groups returned for
    regeneration): 3 steps, every trained group trained once, every trained sample within the
    staleness bound, and the run (its shutdown included) ends."""
    import os
    import subprocess
    import sys

    from buffer.arrow import read_parquet

    root = Path(__file__).resolve().parents[1]
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    config = tmp_path / "toy.yaml"  # the toy config without evaluation (fully_async does not evaluate)
    config.write_text("".join(line for line in open(root / "examples/toy/grpo_cpu.yaml")
                              if not line.startswith(("eval-interval:", "eval-prompt-data:"))))
    cmd = [sys.executable, str(root / "scripts/train.py"), "--config", str(config),
           "--hf-checkpoint", str(toy_model_dir), "--prompt-data", str(toy_model_dir / "data/train.jsonl"),
           "--no-build-toy-model", "--no-plots", "--output-dir", str(out), "--buffer-name", f"buf-{tmp_path.name}",
           "--num-rollout", "3", "--rollout-function-path", path,
           "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
           "--sglang-server-concurrency", "1", "--rollout-max-response-len", "4",
           "--max-weight-staleness", "1", "--stale-policy", "return",
           "--save", str(ckpt), "--save-interval", "3", "--save-debug-rollout-data", str(out / "dump_{rollout_id}.parquet")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "tests"), str(root)]), PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    trained, lags = [], []
    for step in range(3):
        for group in read_parquet(out / f"dump_{step}.parquet"):
            trained.append(group[0].group_index)
            lags += [step - min(s.weight_versions) for s in group]
    assert len(trained) == 6 and len(set(trained)) == 6, trained  # each group trained once
    assert 0 <= min(lags) and max(lags) <= 1, lags  # the staleness bound held for every trained sample
    state = json.loads((ckpt / "step_000002" / "driver_state.json").read_text())["rollout"]
    held = [g[0]["group_index"] for g in state.get("held_groups", [])]
    returned = [g[0]["group_index"] for g in state["data_source"]["returned"]]
    drawn = trained + held + returned
    assert len(drawn) == len(set(drawn)) and set(drawn) <= set(range(state["data_source"]["next_group_index"]))
