"""Benchmark: one torch-backend ``train_step`` (GRPO, 32 samples) on the toy model, CPU.

    python bench/train_step.py [--repeats 7] [--threads 1]
    python bench/train_step.py --device cuda --dtype bfloat16 --hidden-size 1024 --num-layers 8 --groups 16

Baseline, measured in the same run on the same batch and weights: the straightforward padded
implementation (right-pad to ``[B, T]``, logits and log-softmax at every position, masked GRPO
token-mean loss, AdamW) - what a first implementation or a padded trainer does. Two workloads:
``toy`` (the arithmetic task's short answers) and ``varlen`` (responses of 4-160 tokens, where
padding wastes most of the batch). ``ratio`` = baseline time / our time (higher is better).
Writes ``bench/results/train_step.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from buffer.sample import Sample, Status  # noqa: E402
from train_backend import TrainSettings, create_backend  # noqa: E402


def make_groups(tok, rng: random.Random, min_resp: int, max_resp: int, groups: int = 4, n: int = 8):
    out = []
    for g in range(groups):
        text = tok.apply_chat_template([{"role": "user", "content": f"{rng.randrange(20)}+{rng.randrange(20)}="}],
                                       add_generation_prompt=True, tokenize=False)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        grp = []
        for i in range(n):
            resp = [rng.randrange(7, 17) for _ in range(rng.randint(min_resp, max_resp) - 1)] + [tok.eos_token_id]
            grp.append(Sample(group_index=g, index=g * n + i, tokens=prompt + resp, response_length=len(resp),
                              loss_mask=[1] * len(resp), rollout_log_probs=[-2.0] * len(resp),
                              reward=float(rng.random() < 0.5), status=Status.COMPLETED, weight_versions=[0]))
        out.append(grp)
    return out


def baseline_step(model, opt, samples: list[Sample], adv: list[float], dtype: torch.dtype, eps: float = 0.2) -> float:
    """Padded reference implementation of the same GRPO step (float32 masters, autocast compute)."""
    device = next(model.parameters()).device
    B, L = len(samples), max(len(s.tokens) for s in samples)
    ids = torch.zeros(B, L, dtype=torch.long)  # [B, L]
    attn = torch.zeros(B, L, dtype=torch.long)  # [B, L]
    mask = torch.zeros(B, L - 1)  # [B, L-1] loss mask over next-token positions
    for i, s in enumerate(samples):
        ids[i, :len(s.tokens)] = torch.tensor(s.tokens)
        attn[i, :len(s.tokens)] = 1
        mask[i, s.prompt_length - 1:len(s.tokens) - 1] = torch.tensor(s.loss_mask, dtype=torch.float)
    ids, attn, mask = ids.to(device), attn.to(device), mask.to(device)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()  # [B, L-1, V]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, L-1]
    a = torch.tensor(adv, device=device)[:, None]  # [B, 1]
    ratio = torch.exp(logp - logp.detach())  # [B, L-1]
    loss_tok = torch.maximum(-ratio * a, -ratio.clamp(1 - eps, 1 + eps) * a)  # [B, L-1]
    loss = (loss_tok * mask).sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def median_times(fns, repeats: int, warmup: int = 2) -> list[float]:
    """Median wall time of each function; calls are interleaved so that both see the same load."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--hidden-size", type=int, default=64, help="toy model width (64 = the toy model)")
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4, help="groups of 8 samples per step")
    ap.add_argument("--out", default=None, help="default: bench/results/train_step[_<device>].json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from scripts import make_toy_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train_backend.batching import prepare_batch

    metrics: dict[str, float] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_toy_model.main(["--out", str(Path(tmp) / "toy"), "--hidden-size", str(args.hidden_size),
                                         "--num-layers", str(args.num_layers)])
        tok = AutoTokenizer.from_pretrained(model_dir)
        for name, (lo, hi) in {"toy": (2, 4), "varlen": (4, 160)}.items():
            groups = make_groups(tok, random.Random(0), lo, hi, groups=args.groups)
            backend = create_backend(TrainSettings(hf_checkpoint=str(model_dir), device=args.device,
                                                   dtype=args.dtype))
            batch = prepare_batch(groups, "grpo", None, None)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.98), eps=1e-8)
            dtype = getattr(torch, args.dtype)
            ours, base = median_times([lambda: backend.train_step(groups, 0),
                                       lambda: baseline_step(model, opt, batch.samples, batch.advantages, dtype)],
                                      args.repeats)
            del backend, model, opt
            tokens = sum(len(s.tokens) for s in batch.samples)
            metrics.update({f"{name}_ours_s": ours, f"{name}_baseline_s": base, f"{name}_speedup": base / ours,
                            f"{name}_steps_per_min": 60 / ours, f"{name}_tokens_per_s": tokens / ours,
                            f"{name}_tokens": float(tokens)})
            rows.append((name, len(batch.samples), tokens, ours * 1e3, base * 1e3, base / ours, 60 / ours))
    print(f"{'workload':8} {'samples':>7} {'tokens':>7} {'ours ms':>9} {'padded ms':>10} {'speedup':>8} "
          f"{'steps/min':>10}")
    for r in rows:
        print(f"{r[0]:8} {r[1]:7d} {r[2]:7d} {r[3]:9.1f} {r[4]:10.1f} {r[5]:8.2f} {r[6]:10.0f}")
    result = {
        "name": "train_step",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": (torch.cuda.get_device_name() if args.device.startswith("cuda") else
                    f"{platform.machine()} CPU, {args.threads} threads") + f", torch {torch.__version__}",
        "command": "python bench/train_step.py " + " ".join(argv or sys.argv[1:]),
        "metrics": metrics,
        "ratio": min(metrics["toy_speedup"], metrics["varlen_speedup"]),  # the worse workload
        "target": 1.0,
    }
    name = "train_step" if args.device == "cpu" else "train_step_gpu"
    result["name"] = name
    out = Path(args.out or ROOT / "bench" / "results" / f"{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
