"""Peer comparison (issue 7): the toy task under TRL's GRPOTrainer and under Reservoir (sync and
async), same model, lr, batch, samples per prompt and generation length, in one invocation.

    unshare -n bash -c 'ip link set lo up && exec python bench/e2e.py'

For each mode: wall time to the first eval accuracy >= 0.9 (from process start, and from the
start of training), steps to it, steps/s, final accuracy; for Reservoir the median per-step time
split into rollout, buffer wait, training, weight sync and the rest (from metrics.jsonl).
Each run stops at the first eval >= target or at its time cap (then "not reached").
Writes bench/results/e2e.json; ``ratio`` = TRL time-to-target / best Reservoir time-to-target
(from process start), target 1.0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "e2e.json"
SPLIT_KEYS = {"rollout": "perf/rollout_time", "buffer": "perf/buffer_wait_time", "train": "perf/train_time",
              "weight_sync": "perf/weight_sync_time"}


def _env() -> dict[str, str]:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", WANDB_DISABLED="true", PYTHONUNBUFFERED="1")
    return env


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            pass
    return rows


def _session_pids(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    return [int(p) for p, s in (line.split() for line in out.splitlines()) if int(s) == sid and int(p) != os.getpid()]


def _stop(proc: subprocess.Popen, grace_s: float = 120.0) -> None:
    """SIGINT the driver (its ``finally`` shuts Ray down), then TERM/KILL whatever of its session is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(20)
    for sig in (signal.SIGTERM, signal.SIGKILL):  # Ray's processes started by this driver, by pid
        left = _session_pids(proc.pid)
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if left:
            time.sleep(3)


def run_reservoir(mode: str, model: Path, out: Path, cap_s: float, max_steps: int, target: float) -> dict:
    """One Reservoir run through scripts/train.py; stops at the first eval >= target or at cap_s."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / "examples/toy/grpo_cpu.yaml"),
           "--output-dir", str(out / "run"), "--hf-checkpoint", str(model),
           "--prompt-data", str(model / "data/train.jsonl"), "--eval-prompt-data", str(model / "data/eval.jsonl"),
           "--num-rollout", str(max_steps), "--eval-interval", "50", "--no-plots"]
    if mode.startswith("async"):
        cmd += ["--max-weight-staleness", "1"]
    if mode == "async_tis":  # every group is one version behind in async mode: slime's off-policy correction
        cmd += ["--use-tis"]
    metrics = out / "run" / "metrics.jsonl"
    t_launch = time.time()
    with open(out / "stdout.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        reached = None
        try:
            while proc.poll() is None and time.time() - t_launch < cap_s:
                time.sleep(2)
                reached = next((r for r in _read_jsonl(metrics) if r.get("eval/accuracy", -1) >= target), None)
                if reached:
                    break
        finally:
            _stop(proc)
    (out / "launch.json").write_text(json.dumps({"t_launch": t_launch, "exit_code": proc.returncode}))
    return summarize_reservoir(out, target)


def summarize_reservoir(out: Path, target: float) -> dict:
    """The mode's numbers from its metrics.jsonl (and launch.json: process start time, exit code).

    ``median_split_s``: per-step medians; ``mean_split_s``: totals / steps, which also shows the
    tail (slow steps on the loaded machine) and ``between_steps`` (logging and the buffer-metrics
    call after each step, outside ``perf/step_time``).
    """
    launch = json.loads((out / "launch.json").read_text())
    t_launch = launch["t_launch"]
    rows = _read_jsonl(out / "run" / "metrics.jsonl")
    steps = [r for r in rows if "perf/step_time" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    if not steps:
        raise RuntimeError(f"reservoir run {out}: no training step logged (see {out / 'stdout.log'})")
    reached = next((r for r in evals if r["eval/accuracy"] >= target), None)
    first = steps[0]
    train_start = first["time"] - first["perf/step_time"] - first.get("perf/eval_time", 0.0)
    wall = steps[-1]["time"] - train_start
    n = len(steps)
    split, mean = {}, {}
    for name, key in SPLIT_KEYS.items():
        split[name] = statistics.median(r.get(key, 0.0) for r in steps)
        mean[name] = sum(r.get(key, 0.0) for r in steps) / n
    others = [r["perf/step_time"] - sum(r.get(k, 0.0) for k in SPLIT_KEYS.values()) - r.get("perf/eval_time", 0.0)
              for r in steps]
    split["other"] = statistics.median(others)
    split["step"] = statistics.median(r["perf/step_time"] for r in steps)
    mean["eval"] = sum(r.get("perf/eval_time", 0.0) for r in steps) / n
    mean["other"] = sum(others) / n
    mean["step"] = sum(r["perf/step_time"] for r in steps) / n
    mean["between_steps"] = wall / n - mean["step"]
    mean["wall_per_step"] = wall / n
    return {
        "time_to_0.9_s": reached["time"] - t_launch if reached else None,
        "time_to_0.9_from_first_step_s": reached["time"] - train_start if reached else None,
        "startup_s": train_start - t_launch,
        "steps_to_0.9": reached["step"] if reached else None,
        "steps": n,
        "steps_per_s": n / wall,
        "final_accuracy": evals[-1]["eval/accuracy"] if evals else None,
        "eval_history": [(r["step"], round(r["eval/accuracy"], 4)) for r in evals],
        "median_split_s": {k: round(v, 4) for k, v in split.items()},
        "mean_split_s": {k: round(v, 4) for k, v in mean.items()},
        "reached": reached is not None, "exit_code": launch["exit_code"], "run_dir": str(out),
    }


def run_trl(model: Path, out: Path, cap_s: float, max_steps: int, target: float) -> dict:
    """TRL's GRPOTrainer in its own process (bench/_trl_toy.py)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "bench" / "_trl_toy.py"), "--model-dir", str(model), "--out-dir", str(out),
           "--max-steps", str(max_steps), "--time-cap-s", str(cap_s), "--eval-interval", "50",
           "--target", str(target)]
    t_launch = time.time()
    with open(out / "stdout.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                              timeout=cap_s + 600)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed (rc {proc.returncode}); see {out / 'stdout.log'}")
    r = json.loads((out / "trl.json").read_text())
    startup = r["train_start_unix"] - t_launch
    return {
        "time_to_0.9_s": r["time_to_target_s"] + startup if r["time_to_target_s"] is not None else None,
        "time_to_0.9_from_first_step_s": r["time_to_target_s"],
        "startup_s": startup, "steps_to_0.9": r["steps_to_target"], "steps": r["steps"],
        "steps_per_s": r["steps_per_s"], "final_accuracy": r["final_accuracy"],
        "eval_history": [(h["step"], round(h["eval/accuracy"], 4)) for h in r["history"]],
        "reached": r["time_to_target_s"] is not None, "capped": r["capped"], "run_dir": str(out),
    }


def _fmt(v, spec: str = ".1f") -> str:
    return "not reached" if v is None else format(v, spec)


def table(metrics: dict[str, dict]) -> str:
    lines = ["| mode | time to 0.9 (s, from start) | from first step (s) | steps to 0.9 | steps/s | final acc | "
             "median step split (s): rollout / buffer / train / weight sync / other | "
             "mean step split (s): same / eval / between steps |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, m in metrics.items():
        s = m.get("median_split_s")
        split = " / ".join(f"{s[k]:.3f}" for k in ("rollout", "buffer", "train", "weight_sync", "other")) if s else "-"
        a = m.get("mean_split_s")
        mean = " / ".join(f"{a[k]:.3f}" for k in ("rollout", "buffer", "train", "weight_sync", "other", "eval",
                                                  "between_steps")) if a else "-"
        lines.append(f"| {mode} | {_fmt(m['time_to_0.9_s'])} | {_fmt(m['time_to_0.9_from_first_step_s'])} | "
                     f"{_fmt(m['steps_to_0.9'], 'd')} (of {m['steps']}) | {m['steps_per_s']:.3f} | "
                     f"{_fmt(m['final_accuracy'], '.3f')} | {split} | {mean} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--work-dir", type=Path, default=None, help="runs go here (default: a new /tmp dir)")
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse a toy model (default: build one)")
    ap.add_argument("--modes", default="trl,sync,async,async_tis")
    ap.add_argument("--cap-s", type=float, default=540.0, help="per Reservoir run, from process start")
    ap.add_argument("--trl-cap-s", type=float, default=720.0, help="TRL run, from the start of training")
    ap.add_argument("--max-steps", type=int, default=800)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--merge-as", default=None,
                    help="add this invocation's modes to the existing results file under '<mode>_<suffix>' "
                         "(a supplementary run, e.g. a longer TRL cap), keeping the rest of it")
    ap.add_argument("--resummarize", action="store_true",
                    help="recompute the Reservoir modes of the results file from their run directories "
                         "(metrics.jsonl + launch.json); runs nothing")
    args = ap.parse_args(argv)
    if args.resummarize:
        result = json.loads(RESULT.read_text())
        for k, m in result["metrics"].items():
            if k.startswith("reservoir"):
                result["metrics"][k] = summarize_reservoir(Path(m["run_dir"]), args.target)
        RESULT.write_text(json.dumps(result, indent=1) + "\n")
        print(table(result["metrics"]))
        return result

    work = args.work_dir or Path(f"/tmp/e2e-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}")
    work.mkdir(parents=True, exist_ok=True)
    model = args.model_dir
    if model is None:  # the same initial checkpoint for every mode
        model = work / "model"
        subprocess.run([sys.executable, str(ROOT / "scripts/make_toy_model.py"), "--out", str(model),
                        "--warmup-steps", "60"], cwd=ROOT, check=True, timeout=600, stdout=subprocess.DEVNULL)
    metrics: dict[str, dict] = {}
    for mode in args.modes.split(","):
        t = time.time()
        print(f"== {mode} ...", flush=True)
        if mode == "trl":
            metrics["trl"] = run_trl(model, work / "trl", args.trl_cap_s, args.max_steps, args.target)
        else:
            metrics[f"reservoir_{mode}"] = run_reservoir(mode, model, work / mode, args.cap_s, args.max_steps,
                                                         args.target)
        print(f"   done in {time.time() - t:.0f}s: {json.dumps(metrics[list(metrics)[-1]])}", flush=True)

    if args.merge_as:
        return _merge(metrics, args, argv)
    ours = [m["time_to_0.9_s"] for k, m in metrics.items() if k.startswith("reservoir") and m["reached"]]
    trl = metrics.get("trl", {})
    best = min(ours) if ours else None
    if best is not None and trl.get("reached"):
        ratio = trl["time_to_0.9_s"] / best
    elif best is not None and "trl" in metrics:  # TRL did not reach it within its cap: a lower bound
        ratio = (trl["startup_s"] + args.trl_cap_s) / best
    else:
        ratio = None
    result = {
        "name": "e2e", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs (shared, loaded), {platform.platform()}, CPU only",
        "command": "unshare -n bash -c 'ip link set lo up && exec python bench/e2e.py "
                   + " ".join(argv if argv is not None else sys.argv[1:]) + "'",
        "metrics": metrics, "ratio": ratio, "ratio_is_lower_bound": bool(ratio and not trl.get("reached")),
        "target": 1.0,
    }
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(table(metrics))
    print(f"ratio (TRL time / best Reservoir time, from process start) = {ratio}  (target 1.0)")
    return result


def _merge(metrics: dict[str, dict], args: argparse.Namespace, argv: list[str] | None) -> dict:
    """Add a supplementary run's modes to bench/results/e2e.json without touching the main run's."""
    result = json.loads(RESULT.read_text())
    cmd = "python bench/e2e.py " + " ".join(argv if argv is not None else sys.argv[1:])
    for mode, m in metrics.items():
        m["note"] = f"supplementary run ({dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}): {cmd}"
        result["metrics"][f"{mode}_{args.merge_as}"] = m
    ours = [m["time_to_0.9_s"] for k, m in result["metrics"].items() if k.startswith("reservoir") and m["reached"]]
    trl = [m for k, m in metrics.items() if k.startswith("trl") and m["reached"]]
    if ours and trl:
        result["ratio_supplementary"] = trl[0]["time_to_0.9_s"] / min(ours)
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result["metrics"]))
    print(f"ratio (main run) = {result['ratio']}; with the supplementary run = {result.get('ratio_supplementary')}")
    return result


if __name__ == "__main__":
    main()
