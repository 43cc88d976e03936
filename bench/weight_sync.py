"""Benchmark: wall time of a weight push (pause -> continue) against a bare broadcast of the same bytes.

    python bench/weight_sync.py --device cpu     # gloo, 64 MiB and 256 MiB weight sets (2-core box)
    python bench/weight_sync.py --device cuda    # nccl, trainer on cuda:0, engine on cuda:1;
                                                 # 0.5B / 1.5B / 7B llama-family shapes, bf16

For each weight set: write a random-weight HF checkpoint, start one embedded engine
(``python -m embedded_engine``) on it, connect a ``WeightSender`` and time ``--repeats``
pushes after a warm-up; then one more push of changed values (every weight negated), the way
the timed ones are sent, followed by a per-tensor checksum comparison with the engine, so the
numbers are for pushes that really land. Then the ceiling: a bare broadcast of the same bytes from the trainer process to a
plain receiver process on the engine's device, both in the bucket sizes of the push and as one
tensor; the ceiling is the faster of the two. ``ratio`` = push GiB/s / ceiling GiB/s (medians),
the worst over the sets the issue targets (1.5B and 7B on GPU; every set on CPU).
Ray-free and SGLang-free: it needs torch, transformers and the repository only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

GiB = 1024 ** 3
# llama-family shapes (sizes of Qwen2.5-0.5B/1.5B/7B, untied), and small sets for CPU.
SETS = {
    "64MiB": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=16000),
    "256MiB": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=6, num_attention_heads=16,
                   num_key_value_heads=8, vocab_size=16000),
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
}
TARGETED = {"cpu": ["64MiB", "256MiB"], "cuda": ["1.5B", "7B"]}


def make_weights(name: str, device: str, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Random bf16 weights with the HF names and shapes of the llama model ``SETS[name]``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SETS[name], max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = [(n, tuple(p.shape)) for n, p in LlamaForCausalLM(cfg).named_parameters()]
    g = torch.Generator(device=device).manual_seed(seed)
    return [(n, (torch.randn(s, generator=g, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16))
            for n, s in shapes]


def one_buffer(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.nn.Parameter]]:
    """``named``'s tensors moved into one flat buffer, as the torch trainer lays out its parameters
    (what the colocated ``mapped`` push hands an engine as one handle)."""
    from train_backend.torch_backend import flatten_parameters

    holder = torch.nn.Module()
    for i, (_, t) in enumerate(named):
        holder.register_parameter(f"p{i}", torch.nn.Parameter(t, requires_grad=False))
    flatten_parameters(holder)
    return [(n, p) for (n, _), p in zip(named, holder.parameters())]


def write_template(name: str, out: Path) -> Path:
    """The config and the toy char tokenizer of the set ``name``, without weights: what an engine
    started with ``--load-format dummy`` reads."""
    from transformers import LlamaConfig

    from scripts.make_toy_model import build_tokenizer

    tmpl = out / f"{name}_template"
    tmpl.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**SETS[name], max_position_embeddings=4096, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
                torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(tmpl)
    build_tokenizer(tmpl)
    return tmpl


def write_checkpoint(name: str, named, out: Path) -> Path:
    """An HF checkpoint of ``named`` (config, the toy char tokenizer, safetensors), via weight_sync.disk."""
    from weight_sync.disk import write_hf_checkpoint

    return write_hf_checkpoint(named, out / name, version=0, hf_checkpoint=write_template(name, out))


def start_engine(model: Path, device: str, port: int, timeout: float = 600.0,
                 extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """``python -m embedded_engine`` on ``model`` (plus ``extra`` flags); waits for /health."""
    import urllib.request

    cmd = [sys.executable, "-m", "embedded_engine", "--model-path", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--device", device, "--dtype", "bfloat16", "--max-running-requests", "4", *extra]
    if device == "cpu":  # see main(): one torch thread per process on CPU
        cmd += ["--num-threads", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"engine did not answer /health within {timeout}s")


def bench_set(named, model: Path, bucket_numels: list[int], args) -> dict:
    """Time pushes to one engine and bare broadcasts to a plain receiver, interleaved.

    Interleaving (bare bucketed, bare single, then one push per variant, ``repeats`` times after a
    warm-up round) exposes both to the same background load, so their medians compare fairly on
    a shared machine. Returns medians per variant and for the bare broadcasts.
    """
    from sglang_protocol.net import free_port
    from weight_sync.engines import check_equal
    from weight_sync.interfaces import WeightSyncSettings
    from sglang_protocol.process_group import init_weight_update_group
    from weight_sync.sender import WeightSender

    port = free_port()
    proc = start_engine(model, args.engine_device, port)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dev = torch.device(args.trainer_device)
    rounds = args.repeats + 1  # the first round is a warm-up (communicators, allocators, page faults)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"buckets": bucket_numels, "rounds": rounds}, f)
    bare_port = free_port()
    recv = subprocess.Popen([sys.executable, __file__, "--bare-receiver", f.name, "--port", str(bare_port),
                             "--engine-device", args.engine_device, "--device", args.device], cwd=ROOT)
    senders = []
    try:
        grp = init_weight_update_group(backend, "127.0.0.1", bare_port, 0, 2, "bare", 300.0,
                                       dev if backend == "nccl" else None)
        grp.broadcast(torch.zeros(1, device=dev))  # NCCL builds its communicator here (it blocks)
        for fmt, bucket in args.variants:
            snd = WeightSender(WeightSyncSettings(backend=backend, bucket_bytes=bucket, load_format=fmt,
                                                  timeout_s=300.0, group_name=f"bench_{fmt}_{bucket}"))
            snd.connect([f"http://127.0.0.1:{port}"])
            senders.append(snd)
        bare_bufs = {"bucketed": [torch.ones(n, dtype=torch.bfloat16, device=dev) for n in bucket_numels],  # [n]
                     "single": [torch.ones(sum(bucket_numels), dtype=torch.bfloat16, device=dev)]}  # [N]
        bare_t: dict[str, list[float]] = {"bucketed": [], "single": []}
        runs: list[list[dict]] = [[] for _ in senders]
        version = 0
        for r in range(rounds):
            for mode in ("bucketed", "single"):
                # The receiver posts its receives only now (a receive posted early would spin on
                # the engine's GPU during the pushes and slow them), and says so before the clock starts.
                grp.store.set(f"go_{r}_{mode}", "1")
                grp.store.wait([f"ready_{r}_{mode}"])
                _sync(dev)
                t = time.perf_counter()
                for b in bare_bufs[mode]:
                    grp.broadcast(b)
                _sync(dev)
                if r:
                    bare_t[mode].append(time.perf_counter() - t)
            for k, snd in enumerate(senders):
                version += 1
                traced = k == 0 and r == rounds - 1  # the head variant's last timed push
                snd.trace = [] if traced else None
                m = snd.push(named, version=version)
                if r:
                    runs[k].append(m)
                if traced:
                    trace = _timeline(snd.trace, port)
        del bare_bufs
        grp.destroy()
        out = {"bare_bucketed_s": statistics.median(bare_t["bucketed"]),
               "bare_single_s": statistics.median(bare_t["single"]), "variants": {}, "trace": trace}
        for (fmt, bucket), snd, rs in zip(args.variants, senders, runs):
            # The timed kind of push really lands: new values (every weight negated, exactly),
            # pushed the timed way, then every engine tensor's checksum against the trainer's.
            for _, t in named:
                t.neg_()
            version += 1
            snd.push(named, version=version)
            checked = {"weight_sync/check_s": snd._loop.run(
                check_equal(snd.engines, named, snd.settings.timeout_s), timeout=600)}
            med = {k.removeprefix("weight_sync/"): statistics.median(x[k] for x in rs)
                   for k in ("weight_sync/time_s", "weight_sync/transfer_s", "weight_sync/pause_s",
                             "weight_sync/continue_s", "weight_sync/pack_first_s")}
            out["variants"][f"{fmt}:{bucket}"] = {
                "push_s": med["time_s"], "push_s_all": [x["weight_sync/time_s"] for x in rs],
                "transfer_s": med["transfer_s"], "pause_s": med["pause_s"], "continue_s": med["continue_s"],
                # bucket 0 packed before the pause (engines still generating): not in push_s
                "pack_first_s": med["pack_first_s"],
                "num_buckets": rs[0]["weight_sync/num_buckets"], "check_s": checked["weight_sync/check_s"]}
        if recv.wait(120) != 0:
            raise RuntimeError(f"bare receiver exited with {recv.returncode}")
        return out
    finally:
        for snd in senders:
            snd.close()
        for p in (proc, recv):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        os.unlink(f.name)


def _timeline(sender_trace: list, port: int) -> list[str]:
    """One push's timeline, trainer and engine events merged, in ms from the pause request.

    Trainer events come from ``WeightSender.trace``; the engine's per-bucket timings from its
    ``/server_info`` (``weight_update_trace``): handler entered, receive queued, weights applied.
    Both use perf_counter (CLOCK_MONOTONIC, shared by the processes of one host).
    """
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=30) as r:
        engine = json.loads(r.read())["weight_update_trace"]
    t0 = sender_trace[0][2]
    events = [(t, f"trainer {name}" + (f" {i}" if i >= 0 else "")) for name, i, t in sender_trace]
    engine = [e for e in engine if e["handler"] >= t0][-len({i for _, i, _ in sender_trace if i >= 0}):]
    for i, e in enumerate(engine):
        for key in ("handler", "recv_start", "recv_queued", "applied"):
            if key in e:
                events.append((e[key], f"engine  {key} {i} ({e['bytes'] / 2**20:.0f} MiB)" if key == "handler"
                               else f"engine  {key} {i}"))
    lines = [f"{(t - t0) * 1e3:9.3f} ms  {what}" for t, what in sorted(events)]
    print("\n".join(["timeline of the last push:"] + lines), file=sys.stderr)
    return lines


def bare_receiver(plan_file: str, port: int, device: str, backend: str) -> None:
    """Rank 1 of the bare broadcast: receives what ``bench_set`` sends, into preallocated buffers."""
    from sglang_protocol.process_group import init_weight_update_group

    plan = json.loads(Path(plan_file).read_text())
    dev = torch.device(device)
    grp = init_weight_update_group(backend, "127.0.0.1", port, 1, 2, "bare", 300.0, dev if backend == "nccl" else None)
    grp.broadcast(torch.zeros(1, device=dev))  # NCCL builds its communicator here (it blocks)
    bufs = {"bucketed": [torch.empty(n, dtype=torch.bfloat16, device=dev) for n in plan["buckets"]],  # [n]
            "single": [torch.empty(sum(plan["buckets"]), dtype=torch.bfloat16, device=dev)]}  # [N]
    for r in range(plan["rounds"]):
        for mode in ("bucketed", "single"):
            grp.store.wait([f"go_{r}_{mode}"])
            if backend == "gloo":  # a gloo receive blocks until the data is here
                grp.store.set(f"ready_{r}_{mode}", "1")
            for b in bufs[mode]:
                grp.broadcast(b)  # nccl: queued on the GPU
            if backend == "nccl":
                grp.store.set(f"ready_{r}_{mode}", "1")
            _sync(dev)  # nothing of ours runs on the GPU while the pushes are timed
    grp.destroy()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sets", nargs="+", default=None, help=f"weight sets of {list(SETS)} (default: per device)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-bytes", type=int, default=None, help="default: WeightSyncSettings.bucket_bytes")
    ap.add_argument("--load-format", default=None, choices=["flattened_bucket", "tensor"],
                    help="default: WeightSyncSettings.load_format")
    ap.add_argument("--extra-variants", nargs="*", default=[],
                    help="more LOAD_FORMAT:BUCKET_BYTES pushes timed on the same engine (not in the ratio)")
    ap.add_argument("--trainer-device", default=None, help="default: cpu, or cuda:0")
    ap.add_argument("--engine-device", default=None, help="default: cpu, or cuda:1")
    ap.add_argument("--workdir", default=None, help="where checkpoints are written (default: a temp dir)")
    ap.add_argument("--out", default=None, help="default: bench/results/weight_sync.json (cuda), "
                                                 "bench/results/weight_sync_cpu.json (cpu)")
    ap.add_argument("--bare-receiver", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    args.out = args.out or str(ROOT / "bench" / "results" / ("weight_sync.json" if cuda else "weight_sync_cpu.json"))
    args.trainer_device = args.trainer_device or ("cuda:0" if cuda else "cpu")
    args.engine_device = args.engine_device or ("cuda:1" if cuda else "cpu")
    if not cuda:
        # One torch thread per process: trainer, engine and bare receiver share few cores, and
        # oversubscribed OpenMP copies spin (measured on a loaded 2-core box: 530 ms -> 127 ms
        # for a 64 MiB push; the bare gloo broadcast uses no OpenMP and was unaffected).
        torch.set_num_threads(1)
    if args.bare_receiver:
        bare_receiver(args.bare_receiver, args.port, args.engine_device, "nccl" if cuda else "gloo")
        return {}
    from weight_sync.interfaces import TensorSpec, WeightSyncSettings
    from weight_sync.plan import plan_buckets

    if args.bucket_bytes is None:
        args.bucket_bytes = WeightSyncSettings.bucket_bytes
    args.load_format = args.load_format or WeightSyncSettings.load_format
    args.variants = [(args.load_format, args.bucket_bytes)]
    for v in args.extra_variants:
        fmt, _, b = v.partition(":")
        args.variants.append((fmt, int(b)))
    sets = args.sets or (["0.5B", "1.5B", "7B"] if cuda else ["64MiB", "256MiB"])
    if cuda:
        torch.cuda.set_device(torch.device(args.trainer_device))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_ws_"))
    metrics, rows = {}, []
    for name in sets:
        t = time.perf_counter()
        named = make_weights(name, args.trainer_device)
        model = write_checkpoint(name, named, work)
        print(f"[{name}] checkpoint written in {time.perf_counter() - t:.1f}s", file=sys.stderr)
        nbytes = sum(x.numel() * x.element_size() for _, x in named)
        buckets = plan_buckets([TensorSpec.of(n, x) for n, x in named], args.bucket_bytes)
        res = bench_set(named, model, [b.nbytes // 2 for b in buckets], args)
        bare = {"bucketed": res["bare_bucketed_s"], "single": res["bare_single_s"]}
        pushes = res["variants"]
        ceiling = min(bare["bucketed"], bare["single"])
        variants = {}
        for key, p in pushes.items():
            variants[key] = {**p, "push_gib_s": nbytes / GiB / p["push_s"], "ratio": ceiling / p["push_s"]}
        head = variants[f"{args.variants[0][0]}:{args.variants[0][1]}"]
        m = {"bytes": nbytes, "num_buckets": len(buckets), "push_s": head["push_s"], "push_gib_s": head["push_gib_s"],
             "transfer_s": head["transfer_s"], "pause_s": head["pause_s"], "continue_s": head["continue_s"],
             "bare_bucketed_s": bare["bucketed"], "bare_single_s": bare["single"],
             "ceiling_gib_s": nbytes / GiB / ceiling, "ratio": head["ratio"], "checked_equal": True,
             "variants": variants, "trace_last_push": res["trace"]}
        metrics[name] = m
        for key, v in variants.items():
            rows.append((name, key, nbytes / GiB, int(v["num_buckets"]), v["push_s"] * 1e3, v["push_gib_s"],
                         bare["bucketed"] * 1e3, bare["single"] * 1e3, m["ceiling_gib_s"], v["ratio"]))
        shutil_rmtree(work / name)
        del named
        result = _write(args, argv, metrics, rows)  # after every set: a cut-short run keeps what it measured
    print(f"ratio {result['ratio']} (target {result['target']}); wrote {args.out}")
    return result


def _write(args, argv, metrics: dict, rows: list) -> dict:
    print(f"\n{'set':>7} {'variant':>28} {'GiB':>7} {'bkts':>5} {'push ms':>9} {'push GiB/s':>11} "
          f"{'bare bkt ms':>12} {'bare 1 ms':>10} {'ceil GiB/s':>11} {'ratio':>6}")
    for r in rows:
        print(f"{r[0]:>7} {r[1]:>28} {r[2]:7.3f} {r[3]:5d} {r[4]:9.1f} {r[5]:11.2f} {r[6]:12.1f} {r[7]:10.1f} "
              f"{r[8]:11.2f} {r[9]:6.3f}")
    targeted = [metrics[s]["ratio"] for s in TARGETED[args.device] if s in metrics]
    cuda = args.device == "cuda"
    result = {"name": "weight_sync", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": _machine(args), "command": "python bench/weight_sync.py " + " ".join(argv or sys.argv[1:]),
              "metrics": {"device": args.device, "backend": "nccl" if cuda else "gloo",
                          "bucket_bytes": args.bucket_bytes, "load_format": args.load_format,
                          "repeats": args.repeats, "variants": [f"{f}:{b}" for f, b in args.variants],
                          "sets": metrics},
              "ratio": min(targeted) if targeted else None, "target": 0.85}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def shutil_rmtree(p: Path) -> None:
    import shutil

    shutil.rmtree(p, ignore_errors=False)


def _machine(args) -> str:
    if args.device == "cuda":
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        return f"{torch.cuda.device_count()}x {'/'.join(sorted(names))}, torch {torch.__version__}"
    return f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}"


if __name__ == "__main__":
    main()
