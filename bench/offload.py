"""Benchmark: the trainer's offload between colocated phases (``--offload-train`` and
``--offload-train-params``) against bare pinned copies of the same bytes.

    python bench/offload.py                 # 0.5B and 1.5B llama-family trainers, fp32 + AdamW, one GPU

For each weight set (``bench/weight_sync.py``'s shapes): fp32 parameters in one flat buffer (the
torch trainer's layout when colocated), an AdamW step so both moments exist, then ``--repeats``
rounds of ``TrainOffload.offload()`` / ``onload()`` for the optimizer state alone and for the
optimizer state with the parameters, interleaved with the ceiling: one device-to-host and one
host-to-device copy of all the moved bytes between one GPU tensor and one pinned host tensor.
Also recorded: the GPU memory the driver gets back (``cudaMemGetInfo``'s free bytes after an
offload minus before). ``ratio`` = ceiling seconds / offload (or onload) seconds, medians, the
worst over sets, variants and directions. Writes ``bench/results/offload.json``.
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

from train_backend.offload import TrainOffload  # noqa: E402
from train_backend.torch_backend import flatten_parameters  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_weight_sync", ROOT / "bench" / "weight_sync.py")
_ws = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ws)

GiB = 1024 ** 3
TARGET = 0.8


def make_trainer(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """fp32 parameters of the set's shapes in one flat buffer, and AdamW with both moments made."""
    model = torch.nn.Module()
    for i, (_, t) in enumerate(_ws.make_weights(name, "cuda")):
        model.register_parameter(f"p{i}", torch.nn.Parameter(t.float()))
    flatten_parameters(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return model, opt


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def bench_set(name: str, repeats: int) -> dict:
    model, opt = make_trainer(name)
    out = {}
    for variant, params in (("optimizer", False), ("optimizer+params", True)):
        off = TrainOffload(opt, list(model.parameters()), params=params)
        moved = off.offload()  # warm-up: allocates the pinned buffers
        off.onload()
        gpu = torch.empty(moved, dtype=torch.uint8, device="cuda")
        host = torch.empty(moved, dtype=torch.uint8, pin_memory=True)
        rows = {"offload": [], "onload": [], "d2h": [], "h2d": [], "freed": []}
        for _ in range(repeats):
            free0 = torch.cuda.mem_get_info()[0]
            rows["offload"].append(timed(off.offload))
            rows["freed"].append(torch.cuda.mem_get_info()[0] - free0)
            rows["onload"].append(timed(off.onload))
            rows["d2h"].append(timed(lambda: host.copy_(gpu, non_blocking=True)))
            rows["h2d"].append(timed(lambda: gpu.copy_(host, non_blocking=True)))
        del gpu, host, off
        torch.cuda.empty_cache()
        med = {k: statistics.median(v) for k, v in rows.items()}
        out[variant] = {
            "moved_gib": moved / GiB, "freed_gib": med["freed"] / GiB,
            "offload_s": med["offload"], "onload_s": med["onload"], "bare_d2h_s": med["d2h"], "bare_h2d_s": med["h2d"],
            "offload_ratio": med["d2h"] / med["offload"], "onload_ratio": med["h2d"] / med["onload"],
            "trials": rows}
        print(f"{name:>5} {variant:>17} moved {moved / GiB:6.2f} GiB freed {med['freed'] / GiB:6.2f} GiB | "
              f"offload {med['offload'] * 1e3:7.1f} ms (bare {med['d2h'] * 1e3:7.1f}) onload {med['onload'] * 1e3:7.1f} ms "
              f"(bare {med['h2d'] * 1e3:7.1f})", flush=True)
    del model, opt
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--sets", default="0.5B,1.5B", help="comma-separated names of bench/weight_sync.py's SETS")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "offload.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/offload.py needs a GPU (it times copies between GPU and pinned host memory)")
    sets = {name: bench_set(name, args.repeats) for name in args.sets.split(",")}
    ratio = min(min(v["offload_ratio"], v["onload_ratio"]) for s in sets.values() for v in s.values())
    result = {"name": "offload", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"1x {torch.cuda.get_device_name(0)}, torch {torch.__version__}",
              "command": "python bench/offload.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "metrics": {"repeats": args.repeats, "sets": sets}, "ratio": round(ratio, 3), "target": TARGET}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"ratio {result['ratio']} (target {TARGET}); wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
