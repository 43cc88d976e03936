"""Peer comparison (issues 7, 30): a task under TRL's GRPOTrainer and under Reservoir (sync,
async: its default, TIS on; async_tis: --use-tis named; async_no_tis: --no-use-tis), same model, lr
schedule, batch, samples per prompt, generation length and eval set (``TASKS``: the toy arithmetic
task, or ``--task smollm2``), each mode over several seeds, interleaved (seed 1: every mode, then
seed 2, ...; the mode order rotates per seed) so that a slow stretch of the machine does not land on
one mode.

    unshare -n bash -c 'ip link set lo up && exec python bench/e2e.py --seeds 1,2,3,4,5'

Per run: wall time to the first eval accuracy >= the task's target (toy 0.9; from process start,
and from the start of training), steps to it, steps/s, samples/s, final accuracy, the eval curve
against wall time; for Reservoir the median per-step split into rollout, buffer wait, training,
weight sync and the rest (from metrics.jsonl). Each run stops at the first eval >= target or at its
time cap (then "not reached"). Per mode (``metrics[mode]``): its runs under ``seeds`` and their
medians and spread (min, max), a run that did not reach the target counting as infinitely slow.
Writes bench/results/e2e.json and bench/results/e2e.png (eval accuracy against wall time, every mode
and seed); ``ratio`` = TRL's median time-to-target / the best Reservoir mode's median (from process
start; ``ratio_from_first_step`` the same from the start of training).

On a GPU machine, ``--gpu`` runs the race on one GPU (``bench/results/e2e_gpu.json``;
``e2e_gpu_smollm2.json`` with ``--task smollm2``): TRL's GRPOTrainer on CUDA (HF generate) against
Reservoir colocated (the task's GPU config) with real SGLang (``--engine sglang``, the flags the
SGLang bundle needs) or the embedded engine; only ``trl`` and ``sync`` apply (colocated rollout and
training take turns on the one GPU).

    python bench/e2e.py --gpu --engine sglang --modes trl,sync --seeds 1,2
    python bench/e2e.py --gpu --task smollm2 --model-dir examples/smollm2/model --modes trl,sync --seeds 1

A GPU machine's calls last 10 minutes (one seed pair): run each seed with its own ``--out``, then
``python bench/e2e.py --merge FILE... --out bench/results/e2e_gpu.json`` aggregates them as one race.
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
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"  # <name>.json: e2e, e2e_gpu, e2e_gpu_smollm2
# what the SGLang 0.5.15.post1 bundle of ../shared/device needs (no FA3, no grammar backend), and a
# static memory fraction that leaves the colocated trainer room
SGLANG_FLAGS = ["--rollout-engine", "sglang", "--sglang-attention-backend", "triton", "--sglang-sampling-backend",
                "pytorch", "--sglang-grammar-backend", "none", "--sglang-mem-fraction-static", "0.3"]


class Task(NamedTuple):
    """What both sides of a race train on, the same work per step: Reservoir's config (``cpu_config``
    on the CPU, ``gpu_config`` with ``--gpu``) and the settings TRL gets to match it (``bench/_trl_grpo.py``)."""

    cpu_config: str | None  # None: the task runs on a GPU only
    gpu_config: str
    prompts_per_step: int  # --rollout-batch-size
    samples_per_prompt: int  # --n-samples-per-prompt
    response_len: int  # --rollout-max-response-len (and the eval's)
    lr: float
    reward: str  # bench/_trl_grpo.py --reward: "toy" (--rm-type toy_arithmetic) or "math" (--rm-type math)
    wsd: bool  # the toy's WSD schedule (decay over the last quarter, at most 200 steps); else a constant lr
    max_steps: int
    eval_interval: int
    target: float  # eval accuracy
    gpu_flags: tuple[str, ...] = ()  # Reservoir's launcher flags on the GPU beyond the config's

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


TASKS = {
    # the toy arithmetic task: examples/toy/grpo_cpu.yaml, on one GPU examples/gpu/grpo_colocate_1gpu.yaml
    "toy": Task("examples/toy/grpo_cpu.yaml", "examples/gpu/grpo_colocate_1gpu.yaml", 16, 8, 6, 3e-4, "toy",
                wsd=True, max_steps=800, eval_interval=50, target=0.9),
    # SmolLM2-135M-Instruct on two-digit addition (examples/gpu/grpo_smollm2_colocate.yaml; the model from
    # scripts/convert_smollm2.py): eval 0.19-0.22 at step 0, 0.69-0.78 from step 5 to 20 in the recorded runs.
    # No --offload-train: the optimizer state of 135M parameters (~1 GiB) fits beside SGLang, and moving it
    # to the host and back costs ~0.12 s a step (perf/offload_train_time + perf/onload_train_time,
    # gpu_tier_2026-12-05/1500_smol_torch_float32_sglang_metrics.jsonl); TRL keeps it on the GPU too
    "smollm2": Task(None, "examples/gpu/grpo_smollm2_colocate.yaml", 32, 8, 48, 2e-6, "math",
                    wsd=False, max_steps=40, eval_interval=2, target=0.7, gpu_flags=("--no-offload-train",)),
}
SPLIT_KEYS = {"rollout": "perf/rollout_time", "buffer": "perf/buffer_wait_time", "train": "perf/train_time",
              "weight_sync": "perf/weight_sync_time"}


def wsd_decay_steps(max_steps: int) -> int:
    """The lr decay at the end of both sides' WSD schedule: the toy config's 200 of 800 steps."""
    return min(200, max_steps // 4)


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


def run_reservoir(task: Task, mode: str, model: Path, out: Path, cap_s: float, max_steps: int, target: float,
                  seed: int, engine: str | None = None) -> dict:
    """One Reservoir run through scripts/train.py; stops at the first eval >= target or at cap_s.
    ``engine``: None on the CPU (the task's ``cpu_config``); ``embedded`` or ``sglang`` on one GPU,
    colocated (its ``gpu_config``: the same task, batch and lr)."""
    out.mkdir(parents=True, exist_ok=True)
    config = task.cpu_config if engine is None else task.gpu_config
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / config),
           "--output-dir", str(out / "run"), "--hf-checkpoint", str(model),
           "--prompt-data", str(model / "data/train.jsonl"), "--eval-prompt-data", str(model / "data/eval.jsonl"),
           "--num-rollout", str(max_steps), "--eval-interval", str(task.eval_interval),
           "--no-plots", "--seed", str(seed)]
    if task.wsd:
        cmd += ["--lr-decay-iters", str(max_steps), "--lr-wsd-decay-iters", str(wsd_decay_steps(max_steps))]
    if mode.startswith("async"):
        cmd += ["--max-weight-staleness", "1"]
    if mode == "async_tis":  # async's default since issue 30; named, for runs of trees before it
        cmd += ["--use-tis"]
    if mode == "async_no_tis":  # async without the off-policy correction (its default turned off)
        cmd += ["--no-use-tis"]
    if engine is not None:
        cmd += task.gpu_flags
    if engine == "sglang":
        cmd += SGLANG_FLAGS
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
    return summarize_reservoir(out, target, task.samples_per_step)


def summarize_reservoir(out: Path, target: float, samples_per_step: int) -> dict:
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
        "time_to_target_s": reached["time"] - t_launch if reached else None,
        "time_to_target_from_first_step_s": reached["time"] - train_start if reached else None,
        "startup_s": train_start - t_launch,
        "steps_to_target": reached["step"] if reached else None,
        "steps": n,
        "steps_per_s": n / wall,
        "final_accuracy": evals[-1]["eval/accuracy"] if evals else None,
        "samples_per_s": n * samples_per_step / wall,
        "eval_history": [(r["step"], round(r["eval/accuracy"], 4)) for r in evals],
        "curve": [(round(r["time"] - t_launch, 2), r["step"], round(r["eval/accuracy"], 4)) for r in evals],
        "median_split_s": {k: round(v, 4) for k, v in split.items()},
        "mean_split_s": {k: round(v, 4) for k, v in mean.items()},
        "reached": reached is not None, "exit_code": launch["exit_code"], "run_dir": str(out),
    }


def run_trl(task: Task, model: Path, out: Path, cap_s: float, max_steps: int, target: float, seed: int,
            device: str = "cpu") -> dict:
    """TRL's GRPOTrainer in its own process (bench/_trl_grpo.py), set to the task's work per step."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "bench" / "_trl_grpo.py"), "--model-dir", str(model), "--out-dir", str(out),
           "--max-steps", str(max_steps), "--time-cap-s", str(cap_s), "--eval-interval", str(task.eval_interval),
           "--target", str(target), "--seed", str(seed),
           "--decay-steps", str(wsd_decay_steps(max_steps) if task.wsd else 0), "--lr", str(task.lr),
           "--prompts-per-step", str(task.prompts_per_step), "--generations", str(task.samples_per_prompt),
           "--max-new-tokens", str(task.response_len), "--reward", task.reward, "--device", device]
    t_launch = time.time()
    with open(out / "stdout.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                              timeout=cap_s + 600)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed (rc {proc.returncode}); see {out / 'stdout.log'}")
    r = json.loads((out / "trl.json").read_text())
    startup = r["train_start_unix"] - t_launch
    return {
        "time_to_target_s": r["time_to_target_s"] + startup if r["time_to_target_s"] is not None else None,
        "time_to_target_from_first_step_s": r["time_to_target_s"],
        "startup_s": startup, "steps_to_target": r["steps_to_target"], "steps": r["steps"],
        "steps_per_s": r["steps_per_s"], "samples_per_s": (r["steps_per_s"] or 0.0) * task.samples_per_step,
        "final_accuracy": r["final_accuracy"],
        "eval_history": [(h["step"], round(h["eval/accuracy"], 4)) for h in r["history"]],
        "curve": [(round(h["elapsed_s"] + startup, 2), h["step"], round(h["eval/accuracy"], 4)) for h in r["history"]],
        "reached": r["time_to_target_s"] is not None, "capped": r["capped"], "run_dir": str(out),
    }


def _fmt(v, spec: str = ".1f") -> str:
    return "not reached" if v is None or v == float("inf") else format(v, spec)


def _ttt(run: dict, key: str = "time_to_target_s") -> float:
    return run[key] if run["reached"] else float("inf")


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def aggregate(runs: list[dict]) -> dict:
    """A mode's summary over its seeds: medians and spread; an unreached target counts as inf."""
    out = {"seeds": runs, "runs": len(runs), "reached": sum(r["reached"] for r in runs)}
    for key in ("time_to_target_s", "time_to_target_from_first_step_s"):
        out[key] = _spread([_ttt(r, key) for r in runs])
    for key in ("startup_s", "steps_per_s", "samples_per_s", "final_accuracy"):
        out[key] = _spread([r[key] for r in runs if r[key] is not None])
    out["steps_to_target"] = _spread([r["steps_to_target"] if r["reached"] else float("inf") for r in runs])
    splits = [r["median_split_s"] for r in runs if r.get("median_split_s")]
    if splits:
        out["median_split_s"] = {k: round(statistics.median(s[k] for s in splits), 4) for k in splits[0]}
    return out


def table(metrics: dict[str, dict], target: float) -> str:
    lines = [f"| mode | reached | time to {target:g} from start (s): median [min, max] | from first step (s) | "
             f"start-up (s) | steps to {target:g} | steps/s | samples/s | final acc | "
             "median step (s): rollout / buffer / train / weight sync / other |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, m in metrics.items():
        def cell(key: str, spec: str = ".1f", m=m) -> str:
            d = m[key]
            return f"{_fmt(d['median'], spec)} [{_fmt(d['min'], spec)}, {_fmt(d['max'], spec)}]"
        s = m.get("median_split_s")
        split = " / ".join(f"{s[k]:.3f}" for k in ("rollout", "buffer", "train", "weight_sync", "other")) if s else "-"
        lines.append(f"| {mode} | {m['reached']} of {m['runs']} | {cell('time_to_target_s')} | "
                     f"{cell('time_to_target_from_first_step_s')} | {cell('startup_s')} | {cell('steps_to_target', '.0f')} | "
                     f"{cell('steps_per_s', '.2f')} | {cell('samples_per_s', '.0f')} | {cell('final_accuracy', '.3f')} | "
                     f"{split} |")
    return "\n".join(lines)


def plot(metrics: dict[str, dict], target: float, path: Path, task: str = "toy") -> None:
    """Eval accuracy against wall time from process start: one colour per mode, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for i, (mode, m) in enumerate(metrics.items()):
        for j, run in enumerate(m["seeds"]):
            t, _, acc = zip(*run["curve"]) if run["curve"] else ((), (), ())
            ax.plot(t, acc, color=f"C{i}", alpha=0.7, lw=1.2, marker=".", label=mode if j == 0 else None)
    ax.axhline(target, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("wall time from process start (s)")
    ax.set_ylabel("eval accuracy (greedy)")
    ax.set_title(f"{task} task: every mode and seed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--work-dir", type=Path, default=None, help="runs go here (default: a new /tmp dir)")
    ap.add_argument("--task", choices=sorted(TASKS), default="toy",
                    help="toy: the toy arithmetic task; smollm2: SmolLM2-135M-Instruct on two-digit addition (--gpu, "
                         "--model-dir from scripts/convert_smollm2.py)")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="the initial checkpoint (default for --task toy: build the toy model with its warm-up)")
    ap.add_argument("--modes", default=None, help="default: trl,sync,async,async_tis; with --gpu trl,sync")
    ap.add_argument("--seeds", default="1,2,3,4,5", help="one run of every mode per seed, interleaved")
    ap.add_argument("--cap-s", type=float, default=540.0, help="per Reservoir run, from process start")
    ap.add_argument("--trl-cap-s", type=float, default=720.0, help="TRL run, from the start of training")
    ap.add_argument("--max-steps", type=int, default=None, help="default: the task's (toy 800, smollm2 40)")
    ap.add_argument("--target", type=float, default=None,
                    help="eval accuracy; default: the task's (toy 0.9, smollm2 0.7)")
    ap.add_argument("--out", type=Path, default=None,
                    help="the results file, its .png beside it (default: bench/results/ e2e.json, with --gpu "
                         "e2e_gpu.json, with --task smollm2 e2e_gpu_smollm2.json)")
    ap.add_argument("--gpu", action="store_true", help="the race on one GPU: TRL on CUDA, Reservoir colocated")
    ap.add_argument("--engine", choices=["sglang", "embedded"], default="sglang", help="Reservoir's engine with --gpu")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="FILE",
                    help="run nothing: combine these results files' runs (seeds) into --out")
    args = ap.parse_args(argv)
    task = TASKS[args.task]
    name = ("e2e_gpu" if args.gpu else "e2e") + ("" if args.task == "toy" else f"_{args.task}")
    args.out = args.out or RESULTS / f"{name}.json"
    if args.merge:
        return merge(args.merge, args.out)
    target = task.target if args.target is None else args.target
    max_steps = task.max_steps if args.max_steps is None else args.max_steps
    args.modes = args.modes or ("trl,sync" if args.gpu else "trl,sync,async,async_tis")
    modes = args.modes.split(",")
    if args.gpu and not set(modes) <= {"trl", "sync"}:
        ap.error(f"--gpu runs colocated: --modes takes trl and sync only, got {args.modes}")
    if not args.gpu and task.cpu_config is None:
        ap.error(f"--task {args.task} runs on one GPU: add --gpu")
    if args.model_dir is None and args.task != "toy":
        ap.error(f"--task {args.task} needs --model-dir (python scripts/convert_smollm2.py --out DIR)")
    seeds = [int(x) for x in args.seeds.split(",")]

    work = args.work_dir or Path(f"/tmp/e2e-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}")
    work.mkdir(parents=True, exist_ok=True)
    model = args.model_dir
    if model is None:  # the same initial checkpoint for every mode and seed
        model = work / "model"
        subprocess.run([sys.executable, str(ROOT / "scripts/make_toy_model.py"), "--out", str(model),
                        "--warmup-steps", "60"], cwd=ROOT, check=True, timeout=600, stdout=subprocess.DEVNULL)
    runs: dict[str, list[dict]] = {("trl" if m == "trl" else f"reservoir_{m}"): [] for m in modes}
    for i, seed in enumerate(seeds):
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            t = time.time()
            print(f"== seed {seed}: {mode} ...", flush=True)
            out = work / f"{mode}_seed{seed}"
            if mode == "trl":
                r = run_trl(task, model, out, args.trl_cap_s, max_steps, target, seed, "cuda" if args.gpu else "cpu")
            else:
                r = run_reservoir(task, mode, model, out, args.cap_s, max_steps, target, seed,
                                  args.engine if args.gpu else None)
            runs["trl" if mode == "trl" else f"reservoir_{mode}"].append({"seed": seed, **r})
            print(f"   done in {time.time() - t:.0f}s: time to target {_fmt(r['time_to_target_s'])} s, "
                  f"steps {r['steps']}, final {r['final_accuracy']}", flush=True)

    given = " ".join(argv if argv is not None else sys.argv[1:])
    command = (f"python bench/e2e.py {given}" if args.gpu else
               f"unshare -n bash -c 'ip link set lo up && exec python bench/e2e.py {given}'")
    extra = {"task": args.task}
    if args.gpu:
        extra["engine"] = args.engine
        if args.engine == "sglang":
            from importlib.metadata import version
            extra["engine_version"] = version("sglang")
    return write_result(runs, seeds, name, _machine(args.gpu), command, args.out, target, **extra)


def write_result(runs: dict[str, list[dict]], seeds: list[int], name: str, machine: str, command: str, out: Path,
                 target: float, **extra) -> dict:
    """Aggregate each mode's runs, write the results file and its plot, print the table; the result.

    ``target``: the eval accuracy raced to (``accuracy_target``); the file's ``target`` is the ratio's
    (issue 30: 1.5)."""
    metrics = {k: aggregate(v) for k, v in runs.items()}

    def ratio_of(key: str) -> float | None:
        best = min((m[key]["median"] for k, m in metrics.items() if k.startswith("reservoir")), default=float("inf"))
        trl = metrics.get("trl", {}).get(key, {}).get("median", float("inf"))
        return trl / best if best < float("inf") and trl < float("inf") else None

    ratio = ratio_of("time_to_target_s")
    result = {
        "name": name, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine, "command": command, "seeds": seeds, "metrics": metrics, "ratio": ratio,
        "ratio_definition": f"TRL's median time to eval accuracy {target:g} from process start / the best "
                            "Reservoir mode's median",
        "ratio_from_first_step": ratio_of("time_to_target_from_first_step_s"),
        "target": 1.5, "accuracy_target": target, "task": "toy", **extra,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_finite(result), indent=1, allow_nan=False) + "\n")
    plot(metrics, target, out.with_suffix(".png"), result["task"])
    print(table(metrics, target))
    print(f"ratio (TRL median / best Reservoir median, from process start) = {ratio}  (target 1.5); "
          f"from the first step {result['ratio_from_first_step']}")
    return result


#: the run keys' names before the race had tasks other than the toy's (target 0.9): read in old files
_OLD_KEYS = {"time_to_0.9_s": "time_to_target_s", "time_to_0.9_from_first_step_s": "time_to_target_from_first_step_s",
             "steps_to_0.9": "steps_to_target"}


def merge(files: list[Path], out: Path) -> dict:
    """One results file from several of the same benchmark, each holding some seeds (a GPU machine's
    calls are 10 minutes: one seed pair each): every mode's runs together, aggregated again."""
    results = [json.loads(f.read_text()) for f in files]
    kinds = {(r["name"], r.get("accuracy_target", 0.9)) for r in results}
    if len(kinds) != 1:
        raise SystemExit(f"bench/e2e.py: --merge: the files hold different races (name, accuracy target): "
                         f"{sorted(kinds)}")
    runs: dict[str, list[dict]] = {}
    for r in results:
        for mode, m in r["metrics"].items():
            runs.setdefault(mode, []).extend({_OLD_KEYS.get(k, k): v for k, v in run.items()} for run in m["seeds"])
    seeds = sorted({s for r in results for s in r["seeds"]})
    machines = sorted({r["machine"] for r in results})  # joined with " + ": a "|" would split RESULTS.md's table row
    extra = {k: results[0][k] for k in ("engine", "engine_version", "task") if k in results[0]}
    name, target = kinds.pop()
    return write_result(runs, seeds, name, " + ".join(machines),
                        "merged (bench/e2e.py --merge) from: " + " ; ".join(r["command"] for r in results), out,
                        target, **extra)


def _machine(gpu: bool) -> str:
    base = f"{platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}"
    if not gpu:
        return base + ", CPU only"
    import torch
    return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; {base}"


def _finite(obj):
    """``obj`` with every infinite float (a target not reached) as None: JSON has no infinity."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return None if isinstance(obj, float) and obj == float("inf") else obj


if __name__ == "__main__":
    main()
