"""Where the time of a step (and of start-up) goes: the toy config, a few dozen steps, per part.

    unshare -n bash -c 'ip link set lo up && RAY_AUTH_MODE=disabled exec python bench/step_overhead.py'
    ... python bench/step_overhead.py --baseline 2e06dc8 --repeats 3   # before/after, interleaved

Each run is ``scripts/train.py`` on ``examples/toy/grpo_cpu.yaml`` (``--config``: another, e.g. the
toy task colocated on one GPU, ``examples/gpu/grpo_colocate_1gpu.yaml``, with
``--variant "sglang=--rollout-engine sglang ..."`` for real SGLang; ``--steps`` steps, no eval
until the end, no plots) in a child process of its own. The child wraps the driver's start-up and
schedule methods (``Run._start_ray``, ``Run.generate``, ``Run.train``, ...) in ``perf_counter``
spans, so a tree from before the ``perf/...`` breakdown metrics existed is measured the same way;
the parts inside the actors come from the step's metrics (``metric_keys.STEP_BREAKDOWN``), and
what a part's driver span spends outside its actor (the Ray call, the pickling of the batch) is
the span minus the actor's own time. ``--baseline REV`` runs ``git archive REV``'s tree in
alternation with this one (same model, same prompts, same machine), so before/after are compared
within one invocation; ``--variant NAME=FLAGS`` adds runs of this tree with extra launcher flags
(``direct=--rollout-dispatch direct``: the router hop's cost). ``--profile`` adds a cProfile of the
driver's steps (the top functions).

Per run: the median over the steps after ``--warmup`` of each part; over runs: the median, and
the min and max as the spread. ``step_count/driver_ray_remote``: the actor calls the driver makes
per step (each a round trip), ``step_count/driver_ray_blocking_get``: the ``ray.get``s it had to wait
on (a call answered while other work ran costs the step nothing). ``startup_cpu/...``: the CPU seconds each kind of process of the run
(driver, Ray's own, each actor, the engines) had used by the end of the first step, a start-up
measure that a loaded machine disturbs far less than wall time (start-up on 2 cores is CPU-bound). Writes ``bench/results/step_overhead.json`` (``ratio``: the
baseline's median step time / this tree's).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "step_overhead.json"
MODEL = ROOT / "examples" / "toy" / "model"

#: the driver's methods timed as spans: start-up parts, then the schedule's steps (scripts/train.py)
STARTUP_SPANS = ("_maybe_build_toy_model", "_start_ray", "_start_rollout_side", "_start_trainer",
                 "_connect_weight_sync")
#: inside them: the buffer actor, the rollout manager actor (before its engines), the trainer ranks, ...
STARTUP_INNER = ("create_buffer", "create_rollout_manager_actor", "TrainerGroup", "MetricsLogger",
                 "trainer_connect_weight_sync")
STEP_SPANS = ("generate", "get_batch", "train", "update_weights", "maybe_save", "log_step")
#: (name, driver span or metric, actor-side metric): what the span spends outside the actor's own time
OUTSIDE = (("rollout_call_outside_manager", "generate", "perf/rollout_push_time"),
           ("train_call_outside_rank", "train", "train/step_time_s"),
           ("push_call_outside_rank", "update_weights", "perf/weight_push_rank_time"),
           ("push_call_outside_sender", "update_weights", "weight_sync/total_s"))


# --- the child: one run, spans recorded -------------------------------------------------------
def _process_kind(pid: int, cmdline: list[str]) -> str:
    """What a process of the run is, for the CPU account: a Ray worker by its actor (``ray::Name``),
    an engine, a Python script or module by name, else the executable's name."""
    if pid == os.getpid():
        return "driver"
    if cmdline[0].startswith("ray::"):
        return cmdline[0].split(".")[0].split()[0]
    if "embedded_engine" in cmdline:
        return "embedded_engine"
    for i, arg in enumerate(cmdline[1:], 1):
        if arg == "-m" and i + 1 < len(cmdline):
            return cmdline[i + 1]
        if arg.endswith(".py"):
            return Path(arg).name
    return Path(cmdline[0]).name


def _session_cpu() -> dict[str, float]:
    """CPU seconds (user + system) used so far by each kind of process in this process's session
    (the driver, Ray's processes and workers, the engines and the router all live in it), summed:
    on a few cores start-up is bound by this total, which the load of a shared machine changes far
    less than it changes wall times. Processes that already exited are not counted."""
    sid, tick = os.getsid(0), os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_text().split("\0")
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3
        if int(fields[3]) != sid or not cmdline[0]:
            continue
        kind = _process_kind(int(entry.name), cmdline)
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _child(out: Path, steps: int, work: Path, profile: bool, extra: list[str], config: str) -> None:
    t_spawn = float(os.environ["STEP_OVERHEAD_SPAWN"])
    t_main = time.time()
    tree = Path.cwd()
    sys.path.insert(0, str(tree))
    if (tree / "scripts" / "__init__.py").is_file():
        from scripts import components, metrics_log, train
    else:  # a --baseline tree from before scripts/ became a package: its modules by bare name
        import importlib
        sys.path.insert(0, str(tree / "scripts"))
        train, components, metrics_log = (importlib.import_module(m) for m in ("train", "components", "metrics_log"))

    spans: dict[str, list[float]] = {}

    def wrap(name: str, owner=components.Run, as_name: str | None = None) -> None:
        attr, label = name, as_name or name
        fn = getattr(owner, attr, None)
        if fn is None:
            return

        def timed(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                spans.setdefault(label, []).append(time.perf_counter() - t0)
        setattr(owner, attr, timed)

    for name in STARTUP_SPANS + STEP_SPANS + ("finish",):
        wrap(name)
    startup_cpu: dict[str, float] = {}
    calls = _count_driver_ray_calls()
    per_step_calls: list[dict[str, int]] = []
    log_step = components.Run.log_step

    def log_step_then_account(self, *a, **k):
        result = log_step(self, *a, **k)
        if not startup_cpu:  # the first step's log: start-up and one step done
            startup_cpu.update(_session_cpu())
        per_step_calls.append(dict(calls))  # the driver's Ray calls so far, read at each step's end
        return result
    components.Run.log_step = log_step_then_account
    # the start-up's inner parts (imported by the methods at call time, so patched in their modules)
    import buffer
    import rollout_manager.actor
    import train_backend.actor_group
    wrap("create_buffer", buffer, "create_buffer")
    wrap("create_rollout_manager_actor", rollout_manager.actor, "create_rollout_manager_actor")
    wrap("__init__", train_backend.actor_group.TrainerGroup, "TrainerGroup")
    wrap("__init__", metrics_log.MetricsLogger, "MetricsLogger")
    wrap("connect_weight_sync", train_backend.actor_group.TrainerGroup, "trainer_connect_weight_sync")
    start = components.Run.start.__func__
    marks: dict[str, float] = {}

    def timed_start(cls, *a, **k):
        marks["start_begin"] = time.time()
        try:
            return start(cls, *a, **k)
        finally:
            marks["start_end"] = time.time()
    components.Run.start = classmethod(timed_start)
    progress = components.Run.progress

    def timed_progress(self, it):
        marks["loop_begin"] = time.time()
        bar = progress(self, it)
        if profile:
            import cProfile
            marks["profiler"] = cProfile.Profile()
            marks["profiler"].enable()
        return bar
    components.Run.progress = timed_progress

    argv = ["--config", str(tree / config), "--output-dir", str(work / "run"),
            "--hf-checkpoint", str(MODEL), "--prompt-data", str(MODEL / "data/train.jsonl"),
            "--eval-prompt-data", str(MODEL / "data/eval.jsonl"), "--num-rollout", str(steps),
            "--eval-interval", str(10 ** 6), "--skip-eval-before-train", "--no-plots", *extra]
    try:
        train.main(argv)
    finally:
        marks["end"] = time.time()
        if profile and "profiler" in marks:
            import io
            import pstats
            marks["profiler"].disable()
            text = io.StringIO()
            pstats.Stats(marks.pop("profiler"), stream=text).sort_stats("cumulative").print_stats(40)
            (work / "driver_profile.txt").write_text(text.getvalue())
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    out.write_text(json.dumps({"spawn": t_spawn, "main": t_main, "marks": {k: v for k, v in marks.items()
                                                                             if isinstance(v, float)},
                               "spans": spans, "rows": [r for r in rows if "train/step_time_s" in r],
                               "startup_cpu": startup_cpu, "ray_calls": per_step_calls}))


def _count_driver_ray_calls() -> dict[str, int]:
    """Counts, live, the driver's actor calls (``remote``: one round trip each, to the buffer, the
    rollout manager or a rank) and its ``ray.get``s that had to wait (the result was not there yet:
    a round trip the driver sat through rather than one that ran beside other work)."""
    import ray
    import ray.actor

    counts = {"remote": 0, "blocking_get": 0}
    remote, get = ray.actor.ActorMethod._remote, ray.get

    def counted_remote(self, *a, **k):
        counts["remote"] += 1
        return remote(self, *a, **k)

    def counted_get(refs, *a, **k):
        single = refs if isinstance(refs, list) else [refs]
        if single and all(isinstance(r, ray.ObjectRef) for r in single):
            counts["blocking_get"] += len(ray.wait(single, num_returns=len(single), timeout=0)[0]) < len(single)
        return get(refs, *a, **k)
    ray.actor.ActorMethod._remote = counted_remote
    ray.get = counted_get
    return counts


# --- the parent: runs, medians --------------------------------------------------------------
def _tree_of(rev: str, into: Path) -> Path:
    """``git archive rev`` unpacked under ``into`` (the baseline's code, run from there)."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _run_once(tree: Path, steps: int, work: Path, profile: bool, extra: list[str], config: str) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    out = work / "child.json"
    # the tree first; the caller's path after it (on a GPU machine SGLang, Ray and megatron come from there)
    path = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, PYTHONPATH=path, STEP_OVERHEAD_SPAWN=repr(time.time()), RAY_AUTH_MODE="disabled",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_DISABLED="true")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(out), "--steps", str(steps),
           "--work", str(work), "--config", config] + (["--profile"] if profile else [])
    cmd.append(f"--extra={shlex.join(extra)}")
    # a session of its own: the CPU account (_session_cpu) counts the run's processes alone
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, start_new_session=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"run in {tree} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(child: dict, warmup: int) -> dict[str, float]:
    """One run's parts in ms: start-up spans, and per step the median of each part over the steps after ``warmup``."""
    m = child["marks"]
    sp = child["spans"]
    out = {"startup/process_to_main_s": child["main"] - child["spawn"],
           "startup/main_to_start_s": m["start_begin"] - child["main"],
           "startup/run_start_s": m["start_end"] - m["start_begin"],
           "startup/start_to_loop_s": m["loop_begin"] - m["start_end"],
           "startup/total_to_loop_s": m["loop_begin"] - child["spawn"]}
    out.update({f"startup/{name.strip('_')}_s": sp[name][0] for name in STARTUP_SPANS + STARTUP_INNER
                if sp.get(name)})
    if all(sp.get(n) for n in ("_start_rollout_side", "create_buffer", "create_rollout_manager_actor")):
        # what is left of the rollout side: the manager's start (router, engines spawned, healthy, registered)
        out["startup/rollout_manager_start_s"] = (sp["_start_rollout_side"][0] - sp["create_buffer"][0]
                                                  - sp["create_rollout_manager_actor"][0])
    if sp.get("finish"):
        out["teardown/finish_s"] = sp["finish"][0]
    cpu = child.get("startup_cpu") or {}
    out.update({f"startup_cpu/{kind}_s": v for kind, v in cpu.items()})
    if cpu:
        out["startup_cpu/total_s"] = sum(cpu.values())
    rows = child["rows"][warmup:]
    n = len(child["rows"])

    def per_step(values: list[float]) -> float:
        return 1000 * _median(values[warmup:n])
    for name in STEP_SPANS:
        if sp.get(name):
            out[f"step_ms/{name}"] = per_step(sp[name])
    # perf/step_time: the schedule's steps up to the log (scripts/train.py); wall: log to log
    steps = [r["perf/step_time"] for r in child["rows"]]
    out["step_ms/step"] = per_step(steps)
    times = [r["time"] for r in child["rows"]]
    out["step_ms/wall"] = per_step([0.0] + [b - a for a, b in zip(times, times[1:])])
    spans_sum = [sum(sp[name][i] for name in STEP_SPANS[:-1] if name in sp and i < len(sp[name])) for i in range(n)]
    out["step_ms/loop_rest"] = per_step([s - t for s, t in zip(steps, spans_sum)])
    keys = sorted({k for r in rows for k in r if k.startswith(("perf/", "train/time_", "rollout/time_s",
                                                                 "rollout/request_", "rollout/engine_time_s",
                                                                 "weight_sync/", "train/step_time_s"))
                   and (k.endswith(("_s", "_time")) or k.startswith("train/time_"))})
    for k in keys:
        v = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
        if v:
            out[f"metric_ms/{k}"] = 1000 * _median(v)
    for name, span, inner in OUTSIDE:
        if sp.get(span) and all(inner in r for r in rows):
            out[f"step_ms/{name}"] = 1000 * _median([sp[span][i] - r[inner]
                                                     for i, r in zip(range(warmup, n), rows)])
    calls = child.get("ray_calls") or []
    if len(calls) > warmup + 1:  # per step: the difference between step ends, median after the warm-up
        for kind in calls[0]:
            out[f"step_count/driver_ray_{kind}"] = _median([b[kind] - a[kind] for a, b in zip(calls[warmup:], calls[warmup + 1:])])
    out["steps_per_s"] = 1000 / out["step_ms/wall"]
    return out


def _spread(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    keys = sorted({k for r in runs for k in r})
    return {k: {"median": _median(v), "min": min(v), "max": max(v), "runs": v}
            for k in keys for v in [[r[k] for r in runs if k in r]] if v}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="steps per run")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of each run's medians")
    p.add_argument("--repeats", type=int, default=3, help="runs per tree (interleaved with the baseline's)")
    p.add_argument("--baseline", default=None, help="a git revision to run alternately with this tree")
    p.add_argument("--profile", action="store_true", help="cProfile the driver's steps (top functions to stdout)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="also run this tree with extra launcher flags, interleaved (e.g. 'direct=--rollout-dispatch direct')")
    p.add_argument("--config", default="examples/toy/grpo_cpu.yaml",
                   help="the launcher's config, relative to each tree (on one GPU: "
                        "examples/gpu/grpo_colocate_1gpu.yaml, the same toy task colocated; with a variant adding "
                        "the SGLang flags, against real SGLang)")
    p.add_argument("--extra", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(RESULT))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _child(Path(a.child), a.steps, Path(a.work), a.profile, shlex.split(a.extra), a.config)
        return {}
    if not (MODEL / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts/make_toy_model.py"), "--out", str(MODEL)], check=True)
    tmp = Path(tempfile.mkdtemp(prefix="step_overhead_"))
    # this tree as it is now (uncommitted changes included), fixed for the whole invocation
    head = subprocess.run(["git", "-C", str(ROOT), "stash", "create"], capture_output=True, text=True).stdout.strip()
    head_tree = _tree_of(head or "HEAD", tmp / "head_tree")
    trees = {"head": (head_tree, [])}
    if a.baseline:
        trees = {"baseline": (_tree_of(a.baseline, tmp / "baseline_tree"), []), **trees}
    for v in a.variant:
        name, _, flags = v.partition("=")
        trees[name] = (head_tree, shlex.split(flags))
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    failed: list[str] = []
    for i in range(a.repeats):
        for name, (tree, extra) in trees.items():
            work = tmp / f"{name}_{i}"
            try:
                child = _run_once(tree, a.steps, work, a.profile, extra, a.config)
            except RuntimeError as e:  # one failed run (e.g. a variant's engine flag) must not lose the others
                print(f"[{name} {i}] FAILED: {e}", flush=True)
                failed.append(f"{name} {i}")
                continue
            runs[name].append(summarize(child, a.warmup))
            r = runs[name][-1]
            print(f"[{name} {i}] step {r['step_ms/step']:.1f} ms, start-up {r['startup/total_to_loop_s']:.1f} s",
                  flush=True)
            if a.profile and (work / "driver_profile.txt").exists():
                print((work / "driver_profile.txt").read_text()[:6000])
    result = {t: _spread(rs) for t, rs in runs.items() if rs}
    for t, parts in result.items():
        print(f"\n== {t} (median [min, max] over {a.repeats} runs)")
        for k, v in parts.items():
            print(f"  {k:55s} {v['median']:9.2f}  [{v['min']:.2f}, {v['max']:.2f}]")
    doc = {"name": "step_overhead", "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M"),
           "machine": f"{platform.node() and 'vm'} {os.cpu_count()} cores, {platform.machine()}",
           "command": "python bench/step_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "config": {"steps": a.steps, "warmup": a.warmup, "repeats": a.repeats, "baseline": a.baseline,
                      "variants": a.variant},
           "metrics": result, "failed_runs": failed}
    if "baseline" in result and "head" in result:
        # paired: run i of the baseline and run i of this tree ran back to back (the load of a
        # shared machine drifts over minutes): the median of the pairs' differences, and the spread
        pairs = list(zip(runs["baseline"], runs["head"]))
        keys = [k for k in result["head"] if k in result["baseline"] and k.startswith(("step_ms/", "startup/", "metric_ms/"))]
        saved = {k: _spread([{k: b[k] - h[k]} for b, h in pairs if k in b and k in h])[k] for k in keys}
        doc["saved_baseline_minus_head"] = saved
        # ratio: the baseline's median step (log to log) / this tree's, higher is better
        doc["ratio"] = result["baseline"]["step_ms/wall"]["median"] / result["head"]["step_ms/wall"]["median"]
        print("\n== saved (baseline - head: median [min, max] of the pairs' differences)")
        for k, v in saved.items():
            print(f"  {k:55s} {v['median']:9.2f}  [{v['min']:.2f}, {v['max']:.2f}]")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
