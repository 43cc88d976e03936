"""Benchmark: an adapter-only push (``--lora-rank``) against a full push of the same model, same run.

    python bench/weight_sync_lora.py                    # SmolLM2-135M- and 1.5B-shaped, CPU, ~10 GB RAM
    python bench/weight_sync_lora.py --engine sglang    # the same into real SGLang on one GPU, colocated
                                                        # (writes bench/results/weight_sync_lora_sglang.json)

Per set: one embedded bf16 engine (``--load-format dummy --enable-lora``) on a llama model of the
set's shapes; one ``WeightSender`` pushes random bf16 weights of those shapes in full (gloo, the
default transport) ``--repeats`` times, and a random rank-``--rank`` adapter on every linear layer
(peft's format, ``/load_lora_adapter``; ``weight_sync/lora.py``) ``--repeats`` times. Times are
pause to continue (what generation loses) and the whole call (the adapter's file write included);
bytes are what travels. ``ratio`` = full-push time / adapter-push time (whole calls, medians) at 1.5B.
After each push one 1-token request is timed (``first_request_s``): after an adapter push the
embedded engine merges the adapter into its weights there (SGLang applies adapters in its kernels
instead), which is a cost of this CPU engine, not of the push.

With ``--engine sglang`` (the GPU machine): one SGLang server (``--load-format dummy --enable-lora``,
bf16) shares the GPU with the weights, as colocated runs do; the full push is the colocated one
(CUDA IPC, ``mapped``: the weights kept in one buffer as the torch trainer keeps them, SGLang's
loader replayed), the adapter goes as CUDA IPC handles through ``/load_lora_adapter_from_tensors``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.weight_sync import SETS, make_weights, one_buffer, start_engine, write_template  # noqa: E402

SETS.setdefault("smollm2-135m", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                     num_attention_heads=9, num_key_value_heads=3, vocab_size=49152))
# real SGLang servers: the GPU tier's start/stop (tests/_fixtures_sglang.py)
_spec = importlib.util.spec_from_file_location("fixtures_sglang", ROOT / "tests" / "_fixtures_sglang.py")
_sgl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sgl)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(named, rank: int, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """A peft adapter of rank ``rank`` on every linear layer of ``named`` (float32, as the trainer's, on
    the weights' device)."""
    from sglang_protocol.lora_adapter import peft_config

    g = torch.Generator(device=named[0][1].device).manual_seed(seed)
    tensors = {}
    for n, t in named:
        module = n.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in LINEAR:
            out, inp = t.shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, inp, generator=g, device=t.device) * 0.01
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out, rank, generator=g, device=t.device) * 0.01
    return peft_config(rank, 2.0 * rank, list(LINEAR)), tensors


def first_request_s(port: int, lora_path: str | None) -> float:
    """Seconds of one 1-token ``/generate`` (naming ``lora_path``): after an adapter push, the embedded
    engine merges the adapter into its weights here (embedded_engine/lora.py), not during the push."""
    import urllib.request

    body = {"input_ids": [1, 5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    if lora_path:
        body["lora_path"] = lora_path
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1200) as r:
        r.read()
    return time.perf_counter() - t0


def bench_set(name: str, args, work: Path, port: int) -> dict:
    from sglang_protocol.held_weights import LOADER
    from sglang_protocol.lora_adapter import POLICY_ADAPTER
    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    tmpl = write_template(name, work)
    if args.engine == "sglang":
        engine = _sgl.start_sglang(tmpl, port, "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16",
                                   "--custom-weight-loader", LOADER, "--enable-lora", "--max-lora-rank", str(args.rank),
                                   "--lora-target-modules", "all", "--mem-fraction-static", "0.3",
                                   "--disable-cuda-graph", log=work / f"sglang_{name}.log")
        named = one_buffer(make_weights(name, "cuda"))
        s = WeightSyncSettings(transport="tensor", load_format="mapped", timeout_s=1200)
    else:
        engine = start_engine(tmpl, "cpu", port, extra=("--load-format", "dummy", "--enable-lora", "--max-lora-rank",
                                                        str(args.rank), "--weight-update-dirs", str(work)))
        named = make_weights(name, "cpu")
        s = WeightSyncSettings(timeout_s=1200, disk_dir=str(work / "adapters"))
    config, adapter = random_adapter(named, args.rank)
    full, lora = [], []
    try:
        with WeightSender(s) as sender:
            sender.connect([f"http://127.0.0.1:{port}"])
            version = 0
            for r in range(args.repeats + (args.engine == "sglang")):  # SGLang: round 0 warms up (IPC, JIT)
                version += 1
                t0 = time.perf_counter()
                m = sender.push(named, version)
                full.append({"time_s": m["weight_sync/time_s"], "total_s": time.perf_counter() - t0,
                             "bytes": m["weight_sync/bytes"], "first_request_s": first_request_s(port, None)})
                version += 1
                t0 = time.perf_counter()
                m = sender.push_adapter(config, adapter, version)
                lora.append({"time_s": m["weight_sync/time_s"], "total_s": time.perf_counter() - t0,
                             "bytes": m["weight_sync/bytes"], "first_request_s": first_request_s(port, POLICY_ADAPTER)})
                print(f"{name}: full {full[-1]['total_s']:.3f} s {full[-1]['bytes'] / 2**20:.1f} MiB; adapter "
                      f"{lora[-1]['total_s']:.3f} s {lora[-1]['bytes'] / 2**20:.2f} MiB", file=sys.stderr, flush=True)
            if args.engine == "sglang":
                full, lora = full[1:], lora[1:]
    finally:
        if args.engine == "sglang":
            _sgl.stop_sglang(engine)
        else:
            engine.kill()
            engine.wait(30)
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {"parameters": sum(t.numel() for _, t in named), "rank": args.rank,
            "full_bytes": med(full, "bytes"), "adapter_bytes": med(lora, "bytes"),
            "full_time_s": med(full, "time_s"), "adapter_time_s": med(lora, "time_s"),
            "full_total_s": med(full, "total_s"), "adapter_total_s": med(lora, "total_s"),
            "full_first_request_s": med(full, "first_request_s"),
            "adapter_first_request_s": med(lora, "first_request_s"),
            "bytes_ratio": med(full, "bytes") / med(lora, "bytes"),
            "time_ratio": med(full, "total_s") / med(lora, "total_s"), "full": full, "adapter": lora}


def machine(engine: str) -> str:
    if engine == "sglang":
        return (f"{torch.cuda.get_device_name(0)}, SGLang {_sgl.sglang_version()}, torch {torch.__version__}, one GPU "
                "colocated (full: CUDA IPC mapped; adapter: CUDA IPC /load_lora_adapter_from_tensors)")
    return (f"{platform.machine()} {os.cpu_count()} cores (shared), torch {torch.__version__}, CPU (gloo; adapters "
            "from disk)")


def main(argv: list[str] | None = None) -> dict:
    from sglang_protocol.net import pick_port

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", nargs="+", default=["smollm2-135m", "1.5B"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine", choices=["embedded", "sglang"], default="embedded",
                    help="embedded: the CPU engine, adapters from disk; sglang: real SGLang on the GPU, colocated")
    ap.add_argument("--out", default=None, help="default: bench/results/weight_sync_lora[_sglang].json")
    args = ap.parse_args(argv)
    args.out = args.out or str(ROOT / "bench/results" / f"weight_sync_lora{'_sglang' if args.engine == 'sglang' else ''}.json")
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sets:
            results[name] = bench_set(name, args, Path(tmp), pick_port("127.0.0.1"))
    out = {"name": "weight_sync_lora" + ("_sglang" if args.engine == "sglang" else ""), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(args.engine), "command": "python bench/weight_sync_lora.py " + " ".join(argv or sys.argv[1:]),
           "ratio": results["1.5B"]["time_ratio"] if "1.5B" in results else None,
           "bytes_ratio": results["1.5B"]["bytes_ratio"] if "1.5B" in results else None, "target": 5,
           "sets": results}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "sets"}), flush=True)
    return out


if __name__ == "__main__":
    main()
