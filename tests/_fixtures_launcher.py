"""Helpers for the tests that run the launcher (scripts/train.py) as a user does: its command on a
toy checkpoint, and a run that SIGKILLs itself at a fault point (scripts/faults.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launcher_cmd(config: Path, model: Path, out: Path, *extra: str) -> list[str]:
    """``scripts/train.py --config config`` on ``model`` (its own train/eval data), writing to ``out``,
    with a buffer name of its own (runs in one test session do not meet)."""
    return [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(config),
            "--hf-checkpoint", str(model), "--prompt-data", str(model / "data/train.jsonl"),
            "--eval-prompt-data", str(model / "data/eval.jsonl"), "--output-dir", str(out),
            "--no-build-toy-model", "--no-plots", "--buffer-name", f"buf-{out.name}", *extra]


def run_until_it_kills_itself(cmd: list[str], log: Path, crash_at: str, timeout: float = 300) -> None:
    """Run ``cmd`` with ``RESERVOIR_CRASH_AT=crash_at``: the driver SIGKILLs itself there; the rest of
    the job (Ray, engines, router) is then killed with its process group. Asserts the driver died of
    that SIGKILL (its output, in ``log``, shown otherwise)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", RESERVOIR_CRASH_AT=crash_at)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=f, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-4000:]
