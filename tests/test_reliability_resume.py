"""Issue 16: exactly-once training across a driver SIGKILL + ``--load``, with a staleness bound,
in sync and async mode; and across a buffer SIGKILL (its restart window) during the run.

The driver kills itself at an exact point of a step (``RESERVOIR_CRASH_AT``, see
``scripts/faults.py``), after the buffer recorded weight versions and rollouts the checkpoint does
not have. What is checked is what the run recorded: the groups each step trained
(``--save-debug-rollout-data``, written when a step takes its batch, so a redone step's file is
the batch that step finally trained), their weight versions, and ``metrics.jsonl``.

Sync mode with ``--max-weight-staleness 0`` across a SIGKILL is checked by
``tests/test_e2e_train.py::test_sigkill_and_resume_trains_every_group_exactly_once`` (the same
launcher runs that check the data position), so this module pays for two launcher runs, not four:
each costs the start-up of Ray, an engine, the router and the trainer; the steps are cheap.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from buffer.arrow import read_parquet

ROOT = Path(__file__).resolve().parents[1]
STEPS, BATCH, N = 6, 4, 2  # tiny: the cost is the start-up of Ray, one engine, the router and the trainer


def train(model: Path, out: Path, ckpt: Path, *extra: str, crash_at: str = "") -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "scripts/train.py"), "--config", str(ROOT / "examples/toy/grpo_cpu.yaml"),
           "--hf-checkpoint", str(model), "--prompt-data", str(model / "data/train.jsonl"),
           "--eval-prompt-data", str(model / "data/eval.jsonl"), "--no-build-toy-model", "--no-plots",
           "--skip-eval-before-train", "--eval-interval", "1000",
           "--output-dir", str(out), "--buffer-name", f"buf-{out.name}", "--rollout-num-engines", "1",
           "--num-rollout", str(STEPS), "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N),
           "--save", str(ckpt), "--save-interval", "3",
           "--save-debug-rollout-data", str(out / "dump_{rollout_id}.parquet"), *extra]
    env = {k: v for k, v in os.environ.items() if k != "RESERVOIR_CRASH_AT"}
    env.update(PYTHONUNBUFFERED="1", RESERVOIR_CRASH_AT=crash_at)
    # own session: whatever the killed driver leaves behind is killed with its group afterwards
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=400)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout)


def check_exactly_once(out: Path, max_staleness: int) -> None:
    trained = []
    for step in range(STEPS):
        groups = read_parquet(out / f"dump_{step}.parquet")
        trained += [g[0].group_index for g in groups]
        lags = [step - min(s.weight_versions) for g in groups for s in g]
        assert 0 <= min(lags) and max(lags) <= max_staleness, (step, lags)  # the bound held, resume included
    # every group index of every step trained once: none lost, none twice
    assert sorted(trained) == list(range(STEPS * BATCH)), trained
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(STEPS))  # redone steps logged once
    # No regenerated rollout refused as a duplicate: a rollout the checkpoint does not cover must be
    # forgotten at --load, else the buffer keeps the one from the lost run and discards the new one
    # (the group indices alone cannot tell: it is drawn from the same data position)
    assert [r["buffer/duplicate_puts"] for r in steps] == [0] * STEPS


def test_async_router_engine_buffer_driver_and_trainer_kills_then_load_train_every_group_once(toy_model_dir, tmp_path):
    """Async, one version of lag, two engines. First the router is SIGKILLed once step 1 took its
    batch and engine 0 once step 2 trained, each while the producer generates the next rollouts
    through them: the fleet's monitor starts each again (the engine back in the router only once
    a push brought it to the current version), requests in flight fail over or are retried, and
    the push that finds engine 0 dead is redone on the live one; the run goes on. The buffer is
    SIGKILLed once step 4 took its batch, while the producer generates rollout 5 (its
    ``take_returned`` and put retry across the restart, by request and put id). Then the driver
    is killed mid step 5 (after train, before the push): the buffer is at version 5, two past the
    checkpoint's (step 2: version 3), and holds rollout 5, which the checkpoint cannot cover (it
    could start only at version 4, after that save). (Where the producer is when the buffer dies
    is a race: inside its rollout or at its put; exactly once must hold either way.) The resumed
    run then loses its trainer rank in step 4 and ends naming the checkpoint; a second ``--load``
    finishes the run."""
    out, ckpt = tmp_path / "async", tmp_path / "ckpt"
    # a lost group makes a get wait: fail in a minute (a healthy wait is one rollout) instead of hanging
    flags = ["--max-weight-staleness", "1", "--buffer-get-timeout", "60", "--rollout-num-engines", "2",
             "--health-check-interval", "0.5"]
    first = train(toy_model_dir, out, ckpt, *flags, crash_at="router@after_get:1,engine@after_train:2,buffer@after_get:4,after_train:5")
    assert first.returncode == -signal.SIGKILL, first.stdout[-4000:]
    assert "SIGKILL router at after_get of step 1" in first.stdout
    assert "SIGKILL engine at after_train of step 2" in first.stdout
    assert "SIGKILL buffer at after_get of step 4" in first.stdout
    assert "starting it again" in first.stdout, first.stdout[-4000:]  # the monitor saw the router die
    assert "SIGKILL driver at after_train of step 5" in first.stdout
    assert json.loads((ckpt / "latest.json").read_text())["step"] == 2
    # the resumed run loses its trainer rank once step 4 took its batch: it ends, naming the
    # checkpoint, with the producer stopped
    second = train(toy_model_dir, out, ckpt, *flags, "--load", str(ckpt), crash_at="trainer@after_get:4")
    assert second.returncode == 1, second.stdout[-6000:]
    resumed = [line for line in second.stdout.splitlines() if line.startswith("resumed from")]
    assert resumed and int(resumed[0].split(", ")[-1].split()[0]) >= 1, resumed  # rollout 5 generated again
    assert "trainer rank 0 died" in second.stdout, second.stdout[-4000:]
    assert f"the last checkpoint is step 2's: add --load {ckpt}" in second.stdout
    third = train(toy_model_dir, out, ckpt, *flags, "--load", str(ckpt))
    assert third.returncode == 0, third.stdout[-6000:]
    check_exactly_once(out, max_staleness=1)

