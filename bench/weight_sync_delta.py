"""Benchmark: delta weight pushes (``--update-weight-mode delta``) against full pushes, same run.

    python bench/weight_sync_delta.py                      # toy and 0.5B-shaped, CPU (gloo), ~12 GB RAM
    python bench/weight_sync_delta.py --sets toy           # seconds

Per set: a llama model (random init; the 0.5B set has Qwen2.5-0.5B's shapes, untied) with fp32
master weights is trained with Adam at ``--lr`` (1e-6) on a real loss (next-token cross-entropy
on random tokens), and after every step pushed to one embedded bf16 engine (gloo) by one
``WeightSender`` in delta mode with ``--update-weight-full-every 2``: pushes alternate full,
delta, full, ... so every delta is one optimizer step's change, as in a run, and both kinds are
timed against the same engine in the same run. The last push of each kind is checked against
the trainer (``--check-weight-update-equal``: every tensor's checksum). Besides the pushes, each
step's change is encoded offline in both encodings (``xor``, ``overwrite``) over the whole model,
for their bytes and encode time, and the changed fraction of bf16 elements is recorded.

``ratio`` = full-push bytes / delta-push bytes at 0.5B (medians; target >= 30), ``time_ratio``
beside it = full-push time / delta-push time (pause to continue: what generation loses), and
``total_ratio`` the same for the whole ``push`` call (with the packing and the encoding done
before the pause); both without the check's time.
"""

from __future__ import annotations

import argparse
import gc
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

from bench.weight_sync import SETS, start_engine, write_checkpoint  # noqa: E402

TOY = SETS.setdefault("toy", dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=95))  # scripts/make_toy_model.py's shapes


def _model(name: str, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    shapes = TOY if name == "toy" else SETS[name]
    cfg = LlamaConfig(**shapes, max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.02)
    return LlamaForCausalLM(cfg).float()


def _offline(named, prev: dict[str, torch.Tensor]) -> dict:
    """The step's change over the whole model in the engines' dtype, encoded both ways."""
    from sglang_protocol import delta_weights as dw

    out = {"elements": 0, "changed": 0}
    for enc in dw.ENCODINGS:
        out[f"{enc}_bytes"], out[f"{enc}_encode_s"] = 0, 0.0
    for n, t in named:
        new = t.detach().to(torch.bfloat16)
        old = prev.get(n)
        if old is not None:
            out["elements"] += new.numel()
            for enc in dw.ENCODINGS:
                t0 = time.perf_counter()
                payload, k = dw.encode(dw.bits(new), dw.bits(old), enc)
                out[f"{enc}_encode_s"] += time.perf_counter() - t0
                out[f"{enc}_bytes"] += payload.numel()
            out["changed"] += k
        prev[n] = new
    out["changed_fraction"] = out["changed"] / max(out["elements"], 1)
    return out


def bench_set(name: str, args, work: Path, port: int) -> dict:
    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    model = _model(name, args.seed)
    named = lambda: [(n, p) for n, p in model.named_parameters()]  # noqa: E731
    ckpt = write_checkpoint(name, [(n, p.detach().to(torch.bfloat16)) for n, p in named()], work)
    engine = start_engine(ckpt, "cpu", port)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, foreach=False)
    g = torch.Generator().manual_seed(args.seed)
    pushes: list[dict] = []
    prev: dict[str, torch.Tensor] = {}
    try:
        s = WeightSyncSettings(update_mode="delta", full_every=2, delta_encoding=args.encoding, timeout_s=600,
                               bucket_bytes=args.bucket_bytes)
        with WeightSender(s) as sender:
            sender.connect([f"http://127.0.0.1:{port}"])
            _offline(named(), prev)
            for step in range(1, args.steps + 1):
                t0 = time.perf_counter()
                ids = torch.randint(3, model.config.vocab_size, (args.batch, args.seq), generator=g)
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                train_s = time.perf_counter() - t0
                sender.settings.check_equal = step > args.steps - 2  # the last push of each kind
                t0 = time.perf_counter()
                m = sender.push(named(), version=step)
                total = time.perf_counter() - t0
                off = _offline(named(), prev)
                check = m["weight_sync/check_s"]  # the check is not part of a push's cost
                row = {"step": step, "kind": "delta" if m["weight_sync/delta"] else "full",
                       "bytes": m["weight_sync/sent_bytes"], "full_bytes": m["weight_sync/bytes"],
                       "time_s": m["weight_sync/time_s"] - check, "total_s": total - check,
                       "before_pause_s": m["weight_sync/pack_first_s"], "check_s": check, "train_s": train_s,
                       "checked": bool(sender.settings.check_equal), **off}
                pushes.append(row)
                print(f"{name} step {step}: {row['kind']:5} {row['bytes'] / 2**20:9.2f} MiB  push {row['time_s']:.3f} s"
                      f"  total {total:.3f} s  changed {off['changed_fraction']:.4%}  xor {off['xor_bytes'] / 2**20:.2f}"
                      f" MiB  overwrite {off['overwrite_bytes'] / 2**20:.2f} MiB", file=sys.stderr, flush=True)
                gc.collect()
    finally:
        engine.kill()
        engine.wait(30)
    full = [p for p in pushes if p["kind"] == "full"]
    delta = [p for p in pushes if p["kind"] == "delta"]
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {"parameters": sum(p.numel() for p in model.parameters()), "engine_bytes": full[0]["full_bytes"],
            "full_bytes": med(full, "bytes"), "delta_bytes": med(delta, "bytes"),
            "bytes_ratio": med(full, "bytes") / med(delta, "bytes"),
            "full_time_s": med(full, "time_s"), "delta_time_s": med(delta, "time_s"),
            "time_ratio": med(full, "time_s") / med(delta, "time_s"),
            "full_total_s": med(full, "total_s"), "delta_total_s": med(delta, "total_s"),
            "total_ratio": med(full, "total_s") / med(delta, "total_s"),
            "changed_fraction": med(pushes, "changed_fraction"),
            "offline_xor_ratio": med(full, "bytes") / med(pushes, "xor_bytes"),
            "offline_overwrite_ratio": med(full, "bytes") / med(pushes, "overwrite_bytes"),
            "checked_equal": all(p["checked"] for p in pushes[-2:]), "pushes": pushes}


def bench_codec(name: str, args) -> dict:
    """``--codec-device cuda``: no engine, no transport: the same training steps on the GPU, and each
    step's change encoded and applied there, bucket by bucket as a push would (what a push over
    NCCL pays before and after the bytes travel)."""
    from sglang_protocol import delta_weights as dw

    dev = torch.device(args.codec_device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    model = _model(name, args.seed).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    g = torch.Generator(device=dev).manual_seed(args.seed)
    prev = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    steps = []
    for step in range(1, args.steps + 1):
        ids = torch.randint(3, model.config.vocab_size, (args.batch, args.seq), generator=g, device=dev)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        row = {"step": step, "full_bytes": 0, "changed": 0}
        for enc in dw.ENCODINGS:
            row[f"{enc}_bytes"], row[f"{enc}_encode_s"], row[f"{enc}_apply_s"] = 0, 0.0, 0.0
        news = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
        for n, new in news.items():
            row["full_bytes"] += new.numel() * 2
            for enc in dw.ENCODINGS:
                sync()
                t0 = time.perf_counter()
                payload, k = dw.encode(dw.bits(new), dw.bits(prev[n]), enc)
                sync()
                t1 = time.perf_counter()
                target = prev[n].clone()
                sync()
                t2 = time.perf_counter()
                meta = {"names": [n], "shapes": [list(new.shape)], "dtype": "bfloat16", "n": k, "enc": enc, "base": "0"}
                dw.apply(meta, payload.to(dev), [target])
                sync()
                row[f"{enc}_encode_s"] += t1 - t0
                row[f"{enc}_apply_s"] += time.perf_counter() - t2
                row[f"{enc}_bytes"] += payload.numel()
                assert torch.equal(dw.bits(target), dw.bits(new)), n
            row["changed"] += k
        prev = news
        row["changed_fraction"] = row["changed"] / (row["full_bytes"] / 2)
        steps.append(row)
        print(f"{name} step {step}: changed {row['changed_fraction']:.4%}  xor {row['xor_bytes'] / 2**20:.2f} MiB "
              f"(encode {row['xor_encode_s']:.3f} s, apply {row['xor_apply_s']:.3f} s)  overwrite "
              f"{row['overwrite_bytes'] / 2**20:.2f} MiB (encode {row['overwrite_encode_s']:.3f} s)", file=sys.stderr)
    med = lambda k: statistics.median(r[k] for r in steps)  # noqa: E731
    return {"parameters": sum(p.numel() for p in model.parameters()), "full_bytes": steps[0]["full_bytes"],
            "changed_fraction": med("changed_fraction"),
            **{f"{enc}_{what}": med(f"{enc}_{what}") for enc in dw.ENCODINGS for what in ("bytes", "encode_s", "apply_s")},
            "xor_ratio": steps[0]["full_bytes"] / med("xor_bytes"),
            "overwrite_ratio": steps[0]["full_bytes"] / med("overwrite_bytes"), "steps": steps}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", nargs="+", default=["toy", "0.5B"], choices=["toy", *SETS])
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps (pushes alternate full, delta)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--encoding", default="xor", choices=["xor", "overwrite"])
    ap.add_argument("--bucket-bytes", type=int, default=128 * 2 ** 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=31870)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "weight_sync_delta.json"))
    ap.add_argument("--codec-device", default=None,
                    help="e.g. cuda: only the codec, on that device (no engine, no transport); see bench_codec")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    if args.codec_device:
        sets = {name: bench_codec(name, args) for name in args.sets}
        head = sets.get("0.5B") or sets[args.sets[-1]]
        result = {"name": "weight_sync_delta_codec_" + args.codec_device,
                  "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "machine": (torch.cuda.get_device_name(0) if args.codec_device.startswith("cuda") else platform.machine())
                  + f", torch {torch.__version__}",
                  "command": "python bench/weight_sync_delta.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "metrics": {"lr": args.lr, "optimizer": "Adam (fp32 master weights)", "sets": sets},
                  "ratio": head["xor_ratio"], "target": 30}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return result
    sets = {}
    with tempfile.TemporaryDirectory(prefix="ws_delta_") as tmp:
        for i, name in enumerate(args.sets):
            sets[name] = bench_set(name, args, Path(tmp), args.port + i)
            gc.collect()
    head = sets.get("0.5B") or sets[args.sets[-1]]
    result = {"name": "weight_sync_delta", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, CPU (gloo)",
              "command": "python bench/weight_sync_delta.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "metrics": {"lr": args.lr, "optimizer": "Adam (fp32 master weights)", "engine_dtype": "bfloat16",
                          "encoding": args.encoding, "steps": args.steps, "bucket_bytes": args.bucket_bytes,
                          "sets": sets},
              "ratio": head["bytes_ratio"], "time_ratio": head["time_ratio"], "total_ratio": head["total_ratio"],
              "target": 30}
    for name, r in sets.items():
        print(f"{name:>5}: full {r['full_bytes'] / 2**20:.2f} MiB {r['full_time_s']:.3f} s | delta "
              f"{r['delta_bytes'] / 2**20:.3f} MiB {r['delta_time_s']:.3f} s | bytes x{r['bytes_ratio']:.1f} "
              f"time x{r['time_ratio']:.2f} total x{r['total_ratio']:.2f} | changed {r['changed_fraction']:.3%}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
