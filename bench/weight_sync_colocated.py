"""Benchmark, colocated: a weight push over CUDA IPC (trainer and engine on one GPU) against a bare
same-GPU copy of the same bytes.

    python bench/weight_sync_colocated.py            # 0.5B / 1.5B / 7B llama-family sets, bf16, one GPU
    python bench/weight_sync_colocated.py --engine sglang   # the same into a real SGLang server
                                     # (writes bench/results/weight_sync_colocated_sglang.json)

For each weight set (``bench/weight_sync.py``'s shapes and random bf16 weights, held as the torch
trainer holds them for ``--update-weight-load-format mapped``: ``torch.nn.Parameter`` objects in one
buffer, ``train_backend.torch_backend.flatten_parameters``): start one embedded engine on the trainer's GPU
(``--load-format dummy``: random weights of the set's shapes, which the pushes overwrite; it allows
the held-weights loader, as the engines a run starts do), connect a ``WeightSender`` per variant
with the ``tensor`` transport (SGLang's ``/update_weights_from_tensor``, CUDA IPC handles) and time
``--repeats`` pushes (pause -> continue) per variant after a warm-up round, interleaved with the
ceiling: a bare ``copy_`` of every trainer tensor into a preallocated tensor of the same shape on
the same GPU, and one flat copy of all the bytes (the faster of the two is the ceiling). Then one
more push of changed values (every weight negated) per variant and a per-tensor comparison with
the engine (checksums; SGLang: a read-back), so the timed kind of push really lands (``--check
head``: the head variant's only; ``--check-tensors``: a spread subset). Into SGLang, ``load_replayed`` says whether its held-weights loader
replayed its recorded load (its log). Also timed: the memory
handoff of a colocated step (``EngineMemory``: pause + release the KV cache, then resume +
continue). ``ratio`` = ceiling seconds / push seconds (medians), the worse of the 1.5B and 7B sets
for the head variant. Writes ``bench/results/weight_sync_colocated.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# bench/weight_sync.py's weight sets and engine start (loaded by path: its module name is the package's)
_spec = importlib.util.spec_from_file_location("bench_weight_sync", ROOT / "bench" / "weight_sync.py")
_ws = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ws)
# real SGLang servers: the GPU tier's start/stop (tests/_fixtures_sglang.py)
_spec = importlib.util.spec_from_file_location("fixtures_sglang", ROOT / "tests" / "_fixtures_sglang.py")
_sgl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sgl)

GiB = 1024 ** 3
TARGETED = ["1.5B", "7B"]
TARGET = 0.6


def bare_copy(named, dst: list[torch.Tensor], flat_src: torch.Tensor, flat_dst: torch.Tensor) -> tuple[float, float]:
    """Seconds for a per-tensor ``copy_`` of every trainer tensor, and for one flat copy."""
    sync = torch.cuda.synchronize if flat_src.is_cuda else (lambda: None)  # CPU: a smoke run of the script
    sync()
    t = time.perf_counter()
    for (_, x), d in zip(named, dst):
        d.copy_(x)
    sync()
    per_tensor = time.perf_counter() - t
    t = time.perf_counter()
    flat_dst.copy_(flat_src)
    sync()
    return per_tensor, time.perf_counter() - t


def bench_set(name: str, args, work: Path) -> dict:
    from sglang_protocol.net import free_port
    from weight_sync.engines import EngineMemory, check_equal, fetch_params
    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    from sglang_protocol.held_weights import LOADER

    named = _ws.one_buffer(_ws.make_weights(name, args.device))  # as the torch trainer lays them out
    nbytes = sum(x.numel() * x.element_size() for _, x in named)
    model = _ws.write_template(name, work)
    port = free_port()
    if args.engine == "sglang":  # its own loaders and memory saver; dummy weights, no tokenizer on disk needed
        proc = _sgl.start_sglang(model, port, "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16",
                                 "--custom-weight-loader", LOADER, "--enable-memory-saver", "--mem-fraction-static",
                                 "0.3", "--disable-cuda-graph", log=work / f"sglang_{name}.log")
    else:
        proc = _ws.start_engine(model, args.device, port,
                                extra=("--load-format", "dummy", "--custom-weight-loader", LOADER))
    url = f"http://127.0.0.1:{port}"
    senders = []
    try:
        for fmt, bucket in args.variants:
            snd = WeightSender(WeightSyncSettings(transport="tensor", load_format=fmt, bucket_bytes=bucket,
                                                  timeout_s=600.0, group_name=f"bench_{fmt}_{bucket}"))
            snd.connect([url], [1])
            senders.append(snd)
        memory = EngineMemory([url], WeightSyncSettings(timeout_s=600.0))
        dst = [torch.empty_like(x) for _, x in named]
        flat_src = torch.empty(nbytes, dtype=torch.uint8, device=args.device)  # [bytes]
        flat_dst = torch.empty_like(flat_src)  # [bytes]
        bare: dict[str, list[float]] = {"per_tensor": [], "single": []}
        pushes: list[list[dict]] = [[] for _ in senders]
        handoff: list[dict] = []
        version = 0
        for r in range(args.repeats + 1):  # round 0 warms up (IPC handles, allocators, CUDA context)
            per_tensor, single = bare_copy(named, dst, flat_src, flat_dst)
            for k, snd in enumerate(senders):
                version += 1
                m = snd.push(named, version=version)
                if r:
                    pushes[k].append(m)
            release = memory.release()
            resume = memory.resume()
            if r:
                bare["per_tensor"].append(per_tensor)
                bare["single"].append(single)
                handoff.append({"release_s": release, "resume_s": resume})
        del dst, flat_src, flat_dst
        with torch.no_grad():
            for _, t in named:
                t.neg_()
        variants = {}
        ceiling = min(statistics.median(bare["per_tensor"]), statistics.median(bare["single"]))
        for k, ((fmt, bucket), snd, rs) in enumerate(zip(args.variants, senders, pushes)):
            version += 1
            snd.push(named, version=version)
            check_s = None
            if k == 0 or args.check == "all":
                for e in snd.engines:  # how each compares: checksums (embedded), a read-back (SGLang)
                    e.check_equal = True
                    snd._loop.run(fetch_params(e, 600.0), timeout=900)
                step = max(1, len(named) // args.check_tensors) if args.check_tensors else 1
                checked = named[::step] + ([named[-1]] if (len(named) - 1) % step else [])
                check_s = snd._loop.run(check_equal(snd.engines, checked, 600.0), timeout=900)
            push_s = statistics.median(x["weight_sync/time_s"] for x in rs)
            variants[f"{fmt}:{bucket}"] = {
                "push_s": push_s, "push_s_all": [x["weight_sync/time_s"] for x in rs],
                "transfer_s": statistics.median(x["weight_sync/transfer_s"] for x in rs),
                "pause_s": statistics.median(x["weight_sync/pause_s"] for x in rs),
                "continue_s": statistics.median(x["weight_sync/continue_s"] for x in rs),
                "num_buckets": rs[0]["weight_sync/num_buckets"],
                "held_tensors": rs[0].get("weight_sync/held_tensors", 0.0), "push_gib_s": nbytes / GiB / push_s,
                "ratio": ceiling / push_s, "check_s": check_s}
        head = variants[f"{args.variants[0][0]}:{args.variants[0][1]}"]
        return {"bytes": nbytes, "num_tensors": len(named), "push_s": head["push_s"], "ratio": head["ratio"],
                "bare_per_tensor_s": statistics.median(bare["per_tensor"]),
                "bare_single_s": statistics.median(bare["single"]), "ceiling_gib_s": nbytes / GiB / ceiling,
                "handoff_release_s": statistics.median(h["release_s"] for h in handoff),
                "handoff_resume_s": statistics.median(h["resume_s"] for h in handoff),
                "checked_equal": [v for v, x in variants.items() if x["check_s"] is not None],
                "checked_tensors": len(checked),
                "load_replayed": _replayed(work / f"sglang_{name}.log") if args.engine == "sglang" else None,
                "variants": variants}
    finally:
        for snd in senders:
            snd.close()
        if args.engine == "sglang":
            _sgl.stop_sglang(proc)
        else:
            proc.terminate()
            proc.wait(60)
        _ws.shutil_rmtree(model)


def _replayed(log: Path) -> bool | None:
    """Whether the server's held-weights loader recorded its first load and replays it (its log
    says which; None if it says neither)."""
    from sglang_protocol.held_weights import NOT_REPLAYED, REPLAYED

    text = log.read_text(errors="replace")
    if REPLAYED in text:
        return True
    return False if NOT_REPLAYED in text else None


def _engine_version(engine: str) -> str | None:
    return _sgl.sglang_version() if engine == "sglang" else None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--sets", nargs="+", default=["0.5B", "1.5B", "7B"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["mapped:536870912", "flattened_bucket:536870912"],
                    help="LOAD_FORMAT:BUCKET_BYTES pushes timed on the same engine (the first is the head)")
    ap.add_argument("--check", choices=["all", "head"], default="all",
                    help="which variants' last push is compared with the engine (SGLang's read-back of a 7B "
                         "model takes a minute per variant)")
    ap.add_argument("--check-tensors", type=int, default=0,
                    help="compare only about this many tensors, evenly spread, the last included (0: all); "
                         "SGLang's /get_weights_by_name copies a whole tensor to the host per read")
    ap.add_argument("--device", default="cuda:0", help="the one GPU the trainer and the engine share")
    ap.add_argument("--workdir", default="/tmp/bench_ws_colocated")
    ap.add_argument("--engine", choices=["embedded", "sglang"], default="embedded",
                    help="the engine pushed into: the embedded engine or a real SGLang server")
    ap.add_argument("--out", default=None, help="default: bench/results/weight_sync_colocated[_sglang].json")
    args = ap.parse_args(argv)
    args.out = args.out or str(ROOT / "bench" / "results" /
                               f"weight_sync_colocated{'_sglang' if args.engine == 'sglang' else ''}.json")
    args.variants = [(v.partition(":")[0], int(v.partition(":")[2])) for v in args.variants]
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(args.device))
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    sets: dict[str, dict] = {}
    for name in args.sets:
        sets[name] = bench_set(name, args, work)
        s = sets[name]
        for key, v in s["variants"].items():
            print(f"{name:>5} {key:>28} {s['bytes'] / GiB:7.3f} GiB  push {v['push_s'] * 1e3:8.1f} ms "
                  f"({v['push_gib_s']:6.1f} GiB/s)  ceiling {s['ceiling_gib_s']:7.1f} GiB/s  ratio {v['ratio']:.3f}  "
                  f"handoff {s['handoff_release_s'] * 1e3:.1f} + {s['handoff_resume_s'] * 1e3:.1f} ms", flush=True)
        targeted = [sets[k]["ratio"] for k in TARGETED if k in sets]
        result = {"name": Path(args.out).stem, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "machine": f"{torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}",
                  "command": "python bench/weight_sync_colocated.py " + " ".join(argv or sys.argv[1:]),
                  "engine": args.engine, "engine_version": _engine_version(args.engine),
                  "metrics": {"variants": [f"{f}:{b}" for f, b in args.variants], "repeats": args.repeats,
                              "sets": sets},
                  "ratio": min(targeted) if targeted else None, "target": TARGET}
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")  # after every set: a cut run keeps its sets
    print(f"ratio {result['ratio']} (target {TARGET}); wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
