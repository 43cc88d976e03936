"""Issue 29 item 5: the entry points' errors come at once, short, and leave nothing behind.

Each case runs the command as a user does (a subprocess) and checks what they see: the exit status,
at most the usage line and the error on stderr (no option list, no traceback), no output written,
and the answer within 5 s (no Ray, no engine, no trainer started; the launcher's imports alone take
torch, which the launcher imports only once the flags and files are checked).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOY_CONFIG = ROOT / "examples/toy/grpo_cpu.yaml"


def run(cmd: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - t0


def train(model: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "scripts/train.py"), "--config", str(TOY_CONFIG), "--hf-checkpoint", str(model),
            "--prompt-data", str(model / "data/train.jsonl"), "--eval-prompt-data", str(model / "data/eval.jsonl"),
            "--output-dir", str(out), *extra]


def assert_short_error(proc: subprocess.CompletedProcess, seconds: float, code: int, *texts: str) -> None:
    """Exit status ``code``, stderr the usage line and one error line holding ``texts``, nothing
    on stdout, within 5 s."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == code, proc.stderr[-3000:]
    assert len(lines) <= 2, proc.stderr[-3000:]  # the usage line and the error
    assert all(t in lines[-1] for t in texts), lines
    assert "Traceback" not in proc.stderr and not proc.stdout.strip(), proc.stdout[-2000:]
    assert seconds < 5, f"{seconds:.1f} s"


@pytest.mark.parametrize("extra,texts", [
    (["--num-rolout", "3"], ["unrecognized arguments: --num-rolout 3", "did you mean --num-rollout?"]),
    (["--config", "no/such.yaml"], ["--config no/such.yaml: no such file"]),
    (["--num-rollout", "zero"], ["--num-rollout: invalid int value: 'zero'"]),
])
def test_a_usage_error_is_the_usage_line_and_the_error(toy_model_dir, tmp_path, extra, texts):
    proc, seconds = run(train(toy_model_dir, tmp_path / "out", *extra), tmp_path)
    assert_short_error(proc, seconds, 2, *texts)
    assert proc.stderr.startswith("usage: scripts/train.py [options] (--help lists them)\n")
    assert not (tmp_path / "out").exists()


def test_an_unknown_yaml_key_names_the_file_line_and_the_closest_flag(toy_model_dir, tmp_path):
    cfg = tmp_path / "typo.yaml"
    cfg.write_text(TOY_CONFIG.read_text() + "rollout-batchsize: 4\n")
    cmd = train(toy_model_dir, tmp_path / "out")
    cmd[cmd.index(str(TOY_CONFIG))] = str(cfg)
    proc, seconds = run(cmd, tmp_path)
    line = len(cfg.read_text().splitlines())
    assert_short_error(proc, seconds, 2, f"--config {cfg}, line {line}: unknown flag '--rollout-batchsize' "
                                         "(did you mean --rollout-batch-size?)")


@pytest.mark.parametrize("flag,message", [
    ("--prompt-data", "--prompt-data {path}: no such file"),
    ("--eval-prompt-data", "--eval-prompt-data {path}: no such file"),
    ("--load", "--load {path}: no latest.json (not a checkpoint directory written by --save)"),
])
def test_a_missing_input_fails_in_one_line_before_anything_starts(toy_model_dir, tmp_path, flag, message):
    """The run needs the file: it stops before Ray and the engines start, and writes no output
    directory (no metrics.jsonl, no TensorBoard events, no logs)."""
    missing = tmp_path / "missing" / "train.jsonl"
    proc, seconds = run(train(toy_model_dir, tmp_path / "out", flag, str(missing)), tmp_path)
    assert_short_error(proc, seconds, 2, f"scripts/train.py: error: {message.format(path=missing)}")
    assert not (tmp_path / "out").exists()


def test_help_still_lists_every_option():
    from scripts.arguments import build_parser

    text = build_parser().format_help()
    assert "--num-rollout" in text and "--prompt-data" in text and len(text.splitlines()) > 100


@pytest.mark.parametrize("extra,texts", [
    (["--outptu", "x.parquet"], ["unrecognized arguments: --outptu x.parquet", "did you mean --output?"]),
    (["--prompt-data", "nope.jsonl", "--output", "x.parquet"], ["--prompt-data nope.jsonl: no such file"]),
    (["--output", "x.parquet", "--eval-prompt-data", "nope.jsonl"], ["--eval-prompt-data nope.jsonl: no such file"]),
])
def test_the_rollout_command_fails_fast_too(toy_model_dir, tmp_path, extra, texts):
    cmd = [sys.executable, "-m", "rollout_manager", "--hf-checkpoint", str(toy_model_dir),
           "--prompt-data", str(toy_model_dir / "data/train.jsonl"), "--log-dir", str(tmp_path / "logs"), *extra]
    proc, seconds = run(cmd, tmp_path)
    assert_short_error(proc, seconds, 2, *texts)
    assert proc.stderr.startswith("usage: python -m rollout_manager [options] (--help lists them)\n")
    assert not (tmp_path / "x.parquet").exists() and not (tmp_path / "logs").exists()
