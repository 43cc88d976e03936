"""Benchmark of the embedded engine (issue 3): generation throughput at 1, 8 and 64 concurrent
requests against transformers' batched ``generate`` on the same prompts, on the toy model and on
a ~110M-parameter random llama; and the latency of a short request while long ones run.

    unshare -n bash -c 'ip link set lo up && exec python bench/engine.py'   [--quick]

The engine runs as a subprocess behind HTTP (the real path: EngineClient -> aiohttp -> scheduler);
transformers runs in this process. Both use the same torch thread count, sample at temperature 1
with no top-k/top-p, and generate exactly ``max_new_tokens`` per request (EOS ignored). Each cell
is the median of ``--reps`` runs. ``ratio`` = ours / transformers at 64 concurrent (the lower of
the two models). Writes bench/results/engine.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from typing import Any

import psutil
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from embedded_engine import EngineSettings, launch_engine_process  # noqa: E402
from sglang_protocol.client import EngineClient  # noqa: E402


def build_models(tmp: Path) -> dict[str, Path]:
    from scripts import make_toy_model

    toy = make_toy_model.main(["--out", str(tmp / "toy"), "--num-train", "10", "--num-eval", "4"])
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=95, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    big = tmp / "llama110m"
    LlamaForCausalLM(cfg).save_pretrained(big)
    for f in toy.iterdir():  # the toy tokenizer (vocab 95) serves the larger model too
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, big / f.name)
    return {"toy": toy, "llama110m": big}


def make_prompts(n: int, seed: int, lo: int = 8, hi: int = 24) -> list[list[int]]:
    """``n`` random prompts of ``lo``..``hi`` tokens (ordinary characters of the toy vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(7, 95, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def hf_generate(model, prompts: list[list[int]], new_tokens: int, with_cpu: bool = False) -> Any:
    """transformers' batched generate (left padding); returns seconds (and CPU seconds of this
    process, which runs nothing else meanwhile, if ``with_cpu``)."""
    T = max(map(len, prompts))
    ids = torch.zeros((len(prompts), T), dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(prompts), T), dtype=torch.long)  # [B, T]
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    _sync(model.device)
    cpu = time.process_time()
    t = time.perf_counter()
    # On CUDA, the same attention kernels as the engine (no cuDNN: it builds a graph per new
    # shape, i.e. per decode step, ~24 ms of CPU each on the H200; generate would pay it too)
    kernels = (sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
               if model.device.type == "cuda" else contextlib.nullcontext())
    with torch.inference_mode(), kernels:
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=new_tokens, min_new_tokens=0, eos_token_id=None, pad_token_id=0)
    _sync(model.device)
    dt = time.perf_counter() - t
    cpu = time.process_time() - cpu
    assert out.shape[1] == T + new_tokens
    return (dt, cpu) if with_cpu else dt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def _client(url: str) -> EngineClient:
    return EngineClient(url, timeout=600)


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


async def engine_generate(c: EngineClient, prompts: list[list[int]], new_tokens: int,
                          proc: psutil.Process | None = None) -> tuple[float, float]:
    """Send the prompts concurrently; returns (wall seconds, engine-process CPU seconds)."""
    sp = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    cpu = _cpu_s(proc) if proc else 0.0
    t = time.perf_counter()
    rs = await asyncio.gather(*[c.generate(input_ids=p, sampling_params=sp, return_logprob=True)
                                for p in prompts])
    dt = time.perf_counter() - t
    cpu = (_cpu_s(proc) - cpu) if proc else 0.0
    assert all(r["meta_info"]["completion_tokens"] == new_tokens for r in rs)
    return dt, cpu


async def short_latency(c: EngineClient, n_long: int, long_tokens: int, n_short: int) -> dict:
    """Latency of 4-token requests sent one after another while ``n_long`` long requests run."""
    # one client (a warm connection pool) for the whole run, as a rollout manager keeps one
    idle = []
    for p in make_prompts(5, 7):
        t = time.perf_counter()
        await c.generate(input_ids=p, sampling_params={"max_new_tokens": 4, "ignore_eos": True})
        idle.append(time.perf_counter() - t)
    longs = [asyncio.create_task(c.generate(input_ids=p, sampling_params={
        "max_new_tokens": long_tokens, "ignore_eos": True})) for p in make_prompts(n_long, 8)]
    while (await c.request("GET", "/get_load"))[0]["num_running_reqs"] < n_long:
        await asyncio.sleep(0.005)
    lat = []
    for p in make_prompts(n_short, 9):
        t = time.perf_counter()
        await c.generate(input_ids=p, sampling_params={"max_new_tokens": 4, "ignore_eos": True})
        lat.append(time.perf_counter() - t)
    overlapped = sum(not x.done() for x in longs)
    t = time.perf_counter()
    await asyncio.gather(*longs)
    rest = time.perf_counter() - t
    lat.sort()
    return {"p50_s": statistics.median(lat), "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "idle_p50_s": statistics.median(idle), "long_still_running_after_shorts": overlapped,
            "long_remaining_s": rest}


def profile_step(path: Path, rows: int, steps: int, threads: int) -> dict:
    """CPU ms per decode step of the runner (no HTTP, no sampling) at ``rows`` rows, native
    forward vs transformers' modules, interleaved; and where the native step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    from embedded_engine.model_runner import ModelRunner

    torch.set_num_threads(threads)
    prompts = make_prompts(rows, 0)
    runners = {mode: ModelRunner(EngineSettings(model_path=str(path), num_threads=threads, native_forward=mode))
               for mode in ("auto", "off")}
    per_step: dict[str, list[float]] = {"auto": [], "off": [], "auto_1row": []}
    with torch.inference_mode():
        for _ in range(3):  # interleaved rounds: both see the same machine load
            for mode, r, ps in (("auto", runners["auto"], prompts), ("off", runners["off"], prompts),
                                ("auto_1row", runners["auto"], prompts[:1])):
                logits, batch = r.prefill(ps)
                for i in range(steps):
                    batch.last_tok = logits.argmax(-1)
                    t = time.thread_time()  # this thread's CPU time: less sensitive to other processes
                    logits = r.decode(batch)
                    per_step[mode].append(time.thread_time() - t)
        logits, batch = runners["auto"].prefill(prompts)
        t = time.thread_time()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                logits = runners["auto"].decode(batch)
        profiled_ms = 1e3 * (time.thread_time() - t) / steps
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops)
    out = {"rows": rows, "steps": steps, "native_ms": 1e3 * statistics.median(per_step["auto"]),
           "transformers_ms": 1e3 * statistics.median(per_step["off"]),
           # one row: the step's fixed cost (Python, dispatch, per-op overhead)
           "native_1row_ms": 1e3 * statistics.median(per_step["auto_1row"]),
           "native_top_ops_share": {e.key: round(e.self_cpu_time_total / total, 3) for e in ops[:8]},
           # under the profiler: the step's CPU time and the part inside aten ops (the rest: Python)
           "profiled_step_ms": profiled_ms, "profiled_in_ops_ms": total / 1e3 / steps}
    print(f"decode step at {rows} rows (CPU ms, median of {3 * steps}): native {out['native_ms']:.2f}, "
          f"transformers' modules {out['transformers_ms']:.2f}; native at 1 row {out['native_1row_ms']:.2f}; "
          f"native step under the profiler "
          f"{profiled_ms:.2f} ms, {out['profiled_in_ops_ms']:.2f} in aten ops, by op (self CPU share): "
          f"{out['native_top_ops_share']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both sides (1: on a shared 2-core box more threads spin against "
                         "other processes and both sides slow down 10x or more)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and reps (a smoke run)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the GPU machine)")
    ap.add_argument("--dtype", default="auto", help="engine and transformers dtype (auto: fp32 CPU, bf16 CUDA)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "engine.json")
    ap.add_argument("--native-forward", default=EngineSettings.native_forward, choices=["auto", "off"],
                    help="the engine's forward: auto (native for llama-family models) or off (transformers' "
                         "modules: the comparison run; no results file)")
    ap.add_argument("--models", default="toy,llama110m",
                    help="comma-separated subset of toy,llama110m (a subset is a partial run: no results file)")
    ap.add_argument("--profile-step", action="store_true",
                    help="only profile the toy's decode step at 64 rows (native vs transformers' modules)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.profile_step:
        with tempfile.TemporaryDirectory() as tmp:
            return profile_step(build_models(Path(tmp))["toy"], 64, 100, args.threads)
    # RL rollouts are decode-heavy (responses longer than prompts): the larger model gets short
    # prompts so that the run measures decoding more than prefill
    # the toy's cells last under a second: twice the reps, as the noise of a shared box weighs more there
    plan = {"toy": {"new_tokens": 200, "reps": 2 * args.reps, "prompt": (8, 24), "long": 200, "n_long": 16,
                    "n_short": 20},
            "llama110m": {"new_tokens": 32, "reps": max(1, args.reps - 1), "prompt": (4, 8), "long": 64,
                          "n_long": 8, "n_short": 5}}
    if args.quick:
        for p in plan.values():
            p.update(new_tokens=p["new_tokens"] // 8, reps=1)
    from transformers import AutoModelForCausalLM

    metrics: dict = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = build_models(Path(tmp))
        wanted = args.models.split(",")
        for name, path in models.items():
            if name not in wanted:
                continue
            cfg = plan[name]
            es = EngineSettings(model_path=str(path), port=0, num_threads=args.threads, random_seed=0,
                                device=args.device, dtype=args.dtype, native_forward=args.native_forward)
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, es.torch_dtype_name(
                json.loads((path / "config.json").read_text()))))
            hf = hf.to(args.device).eval()
            nparams = sum(p.numel() for p in hf.parameters())
            proc, url = launch_engine_process(es, timeout_s=300)
            try:
                eproc = psutil.Process(proc.pid)
                # one event loop and one client (a warm connection pool) for the whole run
                loop = asyncio.new_event_loop()
                client = loop.run_until_complete(_client(url))
                loop.run_until_complete(engine_generate(client, make_prompts(64, 0), 2))  # warm-up, 64 connections
                hf_generate(hf, make_prompts(4, 0), 2)
                for conc in (1, 8, 64):
                    prompts = make_prompts(conc, conc, *cfg["prompt"])
                    tokens = conc * cfg["new_tokens"]
                    t_ours, t_base = [], []
                    for _ in range(cfg["reps"]):  # interleaved, so both sides see the same machine load
                        t_ours.append(loop.run_until_complete(engine_generate(client, prompts, cfg["new_tokens"],
                                                                              eproc)))
                        t_base.append(hf_generate(hf, prompts, cfg["new_tokens"], with_cpu=True))
                    ours, base = (statistics.median(x[0] for x in t_ours), statistics.median(x[0] for x in t_base))
                    ours_cpu, base_cpu = (statistics.median(x[1] for x in t_ours),
                                          statistics.median(x[1] for x in t_base))
                    # CPU seconds are less sensitive to other processes on a shared box than wall time
                    m = {"ours_tok_s": tokens / ours, "hf_tok_s": tokens / base, "ratio": base / ours,
                         "ours_tok_per_cpu_s": tokens / ours_cpu, "hf_tok_per_cpu_s": tokens / base_cpu,
                         "cpu_ratio": base_cpu / ours_cpu, "new_tokens": cfg["new_tokens"], "reps": cfg["reps"]}
                    metrics[f"{name}_c{conc}"] = m
                    rows.append((name, conc, m))
                    print(f"{name:10s} c={conc:3d}  ours {m['ours_tok_s']:9.1f} tok/s   transformers "
                          f"{m['hf_tok_s']:9.1f} tok/s   ratio {m['ratio']:.2f}   (per CPU-second: "
                          f"{m['ours_tok_per_cpu_s']:.1f} vs {m['hf_tok_per_cpu_s']:.1f}, ratio {m['cpu_ratio']:.2f})",
                          flush=True)
                lat = loop.run_until_complete(short_latency(client, cfg["n_long"], cfg["long"], cfg["n_short"]))
                loop.run_until_complete(client.close())
                loop.close()
                # a static batcher (transformers generate) makes a newcomer wait for the batch in flight
                lat["static_batch_wait_s"] = hf_generate(hf, make_prompts(cfg["n_long"], 8), cfg["long"])
                metrics[f"{name}_short_latency"] = lat
                metrics[f"{name}_params"] = nparams
                print(f"{name:10s} short request while long ones run: p50 {lat['p50_s'] * 1e3:.1f} ms, "
                      f"p99 {lat['p99_s'] * 1e3:.1f} ms (idle p50 {lat['idle_p50_s'] * 1e3:.1f} ms; a static "
                      f"batch would make it wait {lat['static_batch_wait_s']:.2f} s)", flush=True)
            finally:
                proc.terminate()
                proc.wait(30)
    ratio = min(metrics[f"{name}_c64"]["ratio"] for name in models if name in wanted)
    result = {"name": "engine", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.node()} {platform.machine()} {torch.get_num_threads()} torch threads, "
                         f"torch {torch.__version__}, device {args.device}"
                         + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""),
              "command": "python bench/engine.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "metrics": metrics, "ratio": ratio, "target": 1.0}
    if not args.quick and set(wanted) >= set(models) and args.native_forward == EngineSettings.native_forward:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"ratio (ours / transformers at 64 concurrent, lower of both models): {ratio:.2f} (target >= 1.0)")
    return result


if __name__ == "__main__":
    main()
