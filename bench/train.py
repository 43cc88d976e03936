"""Benchmark: tokens/s and MFU of one RL training step (GRPO), Megatron backend vs torch backend.

    python bench/train.py                      # GPU: a ~0.5B Qwen2.5-shaped model, 4k-token sequences, bf16
    python bench/train.py --device cpu --tiny  # CPU smoke test: a tiny llama, 128-token sequences, fp32
    python bench/train.py --variants base,chunked,compiled,compiled+swiglu,compiled+compile

``--variants``: the Megatron backend is timed once per variant, on the same weights and data; a
variant is ``+``-joined options: ``base``/``unfused``, ``chunked``, ``compiled`` (``--loss-head``),
``swiglu`` (``--bias-swiglu-fusion``), ``compile`` (``--torch-compile``), ``cudnn``/``flash``
(``--sdpa-backend``), ``fusedadam`` (``--fused-adam``), ``recompute`` (``--recompute-activations``), ``mbt<N>`` (N tokens per
micro-batch instead of ``--max-tokens-per-micro-batch``); ``default`` = the flag defaults (their
per-device auto choices made); any other variant turns on only what it names.

Ceiling, measured in the same run: the chip's dense matmul rate (bf16 8192^3 GEMMs on GPU, fp32
1024^3 on CPU). MFU = model FLOPs per second / that rate, with the usual count of 6 x (matmul
parameters) + 6 x layers x seq x attention width per trained token (causal attention; activation
recomputation not counted). ``ratio`` = the Megatron backend's MFU; the issue's target is 0.40.

Self-checks (the run fails if they fail): every Megatron variant gives the same per-token
log-probs as the torch backend on the same weights (mean abs diff under ``--max-logprob-diff``);
every run's first step (on the initial weights) has the first run's grad norm (within
``--max-grad-norm-rel-diff``) and entropy (2%): a check of each variant's backward; every timed
step has a finite loss and trains on the expected number of tokens.
Writes ``bench/results/train.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from buffer.sample import Sample, Status  # noqa: E402
from train_backend.interfaces import TrainSettings  # noqa: E402


def model_config(tiny: bool) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    if tiny:
        return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                           tie_word_embeddings=False)
    # Qwen2.5-0.5B's shape (0.49B parameters, tied embeddings, GQA 14/2, QKV bias)
    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       tie_word_embeddings=True, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def flops_per_token(cfg: Any, seq: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters + 6 x L x seq x attention width (causal)."""
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    matmul_params = L * per_layer + h * cfg.vocab_size  # + the LM head
    return 6.0 * matmul_params + 6.0 * L * seq * q


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, iters: int) -> float:
    """Median dense GEMM rate of ``[n, n] @ [n, n]`` in TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    rates = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        _sync(device)
        rates.append(10 * 2 * n**3 / (time.perf_counter() - t0) / 1e12)
    return statistics.median(rates)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_groups(rng: random.Random, num_groups: int, n: int, seq: int, prompt: int, vocab: int) -> list:
    out = []
    for g in range(num_groups):
        p = [rng.randrange(3, vocab) for _ in range(prompt)]
        grp = []
        for i in range(n):
            r = seq - prompt
            grp.append(Sample(group_index=g, index=g * n + i, tokens=p + [rng.randrange(3, vocab) for _ in range(r)],
                              response_length=r, loss_mask=[1] * r, rollout_log_probs=[-5.0] * r,
                              reward=float(rng.random()), status=Status.COMPLETED, weight_versions=[0]))
        out.append(grp)
    return out


def time_steps(backend: Any, groups: list, steps: int, device: torch.device, expected_tokens: int
               ) -> tuple[list[float], dict[str, float]]:
    """Step times after one warm-up step, and the warm-up step's metrics (taken on the initial
    weights: comparable across backends and variants)."""
    times, first = [], {}
    for step in range(steps + 1):  # the first step warms up (allocator, kernels): not timed
        _sync(device)
        t0 = time.perf_counter()
        m = backend.train_step(groups, step)
        _sync(device)
        if step:
            times.append(time.perf_counter() - t0)
        else:
            first = m
        if not torch.isfinite(torch.tensor(m["train/loss"])):
            raise RuntimeError(f"non-finite loss {m['train/loss']} in step {step}")
        if round(m["train/tokens_per_s"] * m["train/step_time_s"]) != expected_tokens:
            raise RuntimeError(f"step {step} trained on {m['train/tokens_per_s'] * m['train/step_time_s']:.0f} "
                               f"tokens, expected {expected_tokens}")
    return times, first


VARIANT_OPTIONS = {
    "default": {},
    "base": {"loss_head": "unfused"},
    "unfused": {"loss_head": "unfused"},
    "chunked": {"loss_head": "chunked"},
    "compiled": {"loss_head": "compiled"},
    "swiglu": {"bias_swiglu_fusion": True},
    "compile": {"torch_compile": True},
    "recompute": {"recompute_activations": True},
    "cudnn": {"sdpa_backend": "cudnn"},
    "flash": {"sdpa_backend": "flash"},
    "fusedadam": {"fused_adam": True},
}


def variant_settings(spec: str) -> tuple[Any, int | None]:
    """``(MegatronSettings, micro-batch tokens or None)`` of a ``+``-joined variant name
    (``ValueError`` naming ``--variants``); ``mbt<N>`` overrides ``--max-tokens-per-micro-batch``."""
    from train_backend.megatron.arguments import MegatronSettings

    if spec == "default":  # what the launcher uses (its auto choices are made per device)
        return MegatronSettings(), None
    # Otherwise a variant turns on exactly what it names: the per-device speed-ups start off.
    kw: dict[str, Any] = {"loss_head": "chunked", "bias_swiglu_fusion": False, "torch_compile": False}
    mbt = None
    for opt in spec.split("+"):
        if opt.startswith("mbt") and opt[3:].isdigit():
            mbt = int(opt[3:])
        elif opt in VARIANT_OPTIONS:
            kw.update(VARIANT_OPTIONS[opt])
        else:
            raise ValueError(f"--variants: unknown option {opt!r} in {spec!r} "
                             f"(options: {', '.join(VARIANT_OPTIONS)}, mbt<tokens>)")
    return MegatronSettings(**kw), mbt


def profile_step(name: str, backend: Any, groups: list, step: int, device: torch.device, out: Path) -> None:
    """One profiled step: its top ops are printed and written to ``out``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        backend.train_step(groups, step)
        _sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
    print(f"--- {name}: top ops by {key}\n{table}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"{name}: top ops by {key}\n{table}\n")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny model and sequences (CPU smoke test)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 4096; tiny 128)")
    ap.add_argument("--num-seqs", type=int, default=16, help="sequences per training step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per backend (after one warm-up)")
    ap.add_argument("--max-tokens-per-micro-batch", type=int, default=None,
                    help="micro-batch size in tokens (default 4 sequences: small models are launch-bound)")
    ap.add_argument("--backends", default="megatron,torch",
                    help="megatron (once per --variants entry), torch, torch+compile (decoder layers compiled)")
    ap.add_argument("--variants", default="default",
                    help="comma-separated Megatron backend variants (see the module doc), e.g. base,compiled+swiglu")
    ap.add_argument("--profile", action="store_true",
                    help="print each backend's top kernels for one extra step (also written next to --out)")
    ap.add_argument("--max-logprob-diff", type=float, default=None,
                    help="self-check bound on the mean |logp_megatron - logp_torch| (default 0.05 bf16, 1e-4 fp32)")
    ap.add_argument("--max-grad-norm-rel-diff", type=float, default=0.1,
                    help="self-check bound on the first step's grad norm of each run vs the first run (relative)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "train.json"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    seq = args.seq_len or (128 if args.tiny else 4096)
    dtype = "float32" if device.type == "cpu" else "bfloat16"
    max_diff = args.max_logprob_diff or (1e-4 if dtype == "float32" else 0.05)
    backends = args.backends.split(",")
    for name in backends:
        if name not in ("megatron", "torch", "torch+compile"):
            raise ValueError(f"--backends: unknown backend {name!r} (megatron, torch, torch+compile)")
    variants = args.variants.split(",") if "megatron" in backends else []
    for v in variants:
        variant_settings(v)  # fail on a bad name before any work
    runs = [(name, None) if name != "megatron" else (f"megatron[{v}]", v)
            for name in backends for v in (variants if name == "megatron" else [None])]
    cfg = model_config(args.tiny)

    if device.type == "cuda":
        peak = matmul_tflops(device, torch.bfloat16, 8192, 10)
    else:
        peak = matmul_tflops(device, torch.float32, 1024, 5)
    fpt = flops_per_token(cfg, seq)
    groups = make_groups(random.Random(0), num_groups=max(1, args.num_seqs // 4), n=min(4, args.num_seqs),
                         seq=seq, prompt=min(256, seq // 4), vocab=cfg.vocab_size)
    tokens = sum(len(s.tokens) for g in groups for s in g)
    n_check, p_check = min(seq, 512), min(256, seq // 4)
    check = [s.copy(tokens=s.tokens[:n_check], response_length=n_check - p_check,
                    loss_mask=[1] * (n_check - p_check), rollout_log_probs=None) for s in groups[0][:2]]

    from transformers import AutoModelForCausalLM

    metrics: dict[str, Any] = {"peak_matmul_tflops": round(peak, 2), "flops_per_token": fpt, "seq_len": seq,
                               "tokens_per_step": tokens, "dtype": dtype,
                               "max_tokens_per_micro_batch": args.max_tokens_per_micro_batch or 4 * seq}
    logps: dict[str, list[list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
        metrics["params"] = sum(p.numel() for p in hf.parameters())
        hf.save_pretrained(tmp)
        del hf
        settings = TrainSettings(hf_checkpoint=tmp, backend="torch", device=str(device), dtype=dtype, lr=1e-6,
                                 max_tokens_per_micro_batch=args.max_tokens_per_micro_batch or 4 * seq,
                                 global_batch_size=None)
        for name, variant in runs:
            if variant is not None:
                from train_backend.megatron import create_megatron_backend

                mcfg, mbt = variant_settings(variant)
                backend = create_megatron_backend(
                    settings if mbt is None else dataclasses.replace(settings, max_tokens_per_micro_batch=mbt), mcfg)
            else:
                from train_backend.torch_backend import TorchBackend

                backend = TorchBackend(settings, compile_layers=name == "torch+compile")
            logps[name] = backend.compute_log_probs(check)  # before any update: same weights
            t0 = time.perf_counter()
            times, first = time_steps(backend, groups, args.steps, device, tokens)
            metrics[f"{name}_wall_s"] = round(time.perf_counter() - t0, 1)  # incl. warm-up/compilation
            for k in ("loss", "grad_norm", "entropy"):  # the first step's, on the initial weights
                metrics[f"{name}_step0_{k}"] = first[f"train/{k}"]
            if args.profile:
                out = Path(args.out)
                profile_step(name, backend, groups, args.steps + 1, device,
                             out.with_name(f"{out.stem}.profile.{name.replace('[', '_').replace(']', '').replace('+', '_')}.txt"))
            step_s = statistics.median(times)
            tps = tokens / step_s
            metrics[f"{name}_step_s"] = round(step_s, 4)
            metrics[f"{name}_tokens_per_s"] = round(tps, 1)
            metrics[f"{name}_model_tflops"] = round(tps * fpt / 1e12, 4)
            metrics[f"{name}_mfu"] = round(tps * fpt / (peak * 1e12), 4)
            if device.type == "cuda":
                metrics[f"{name}_max_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
            print(f"{name}: {step_s:.3f} s/step, MFU {metrics[f'{name}_mfu']:.3f}"
                  + (f", peak {metrics[f'{name}_max_mem_gib']} GiB" if device.type == "cuda" else ""), flush=True)
            del backend
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
    ref = next((n for n in ("torch", "torch+compile") if n in logps), None)
    for name in logps:
        if ref is None or name == ref:
            continue
        diffs = [abs(x - y) for ra, rb in zip(logps[name], logps[ref]) for x, y in zip(ra, rb)]
        metrics[f"{name}_logprob_mean_abs_diff"] = statistics.fmean(diffs)
        metrics[f"{name}_logprob_max_abs_diff"] = max(diffs)
        if metrics[f"{name}_logprob_mean_abs_diff"] > max_diff:
            raise RuntimeError(f"self-check failed: {name} and {ref} log-probs differ by "
                               f"{metrics[f'{name}_logprob_mean_abs_diff']} on average (bound {max_diff})")
    # Gradient and entropy self-check: on the initial weights every run's first step must agree
    # (the bounds are far above bf16 noise, far below what a wrong gradient or softmax gives).
    first_run = runs[0][0]
    for name, _ in runs[1:]:
        gn, gn0 = metrics[f"{name}_step0_grad_norm"], metrics[f"{first_run}_step0_grad_norm"]
        ent, ent0 = metrics[f"{name}_step0_entropy"], metrics[f"{first_run}_step0_entropy"]
        if abs(gn - gn0) > args.max_grad_norm_rel_diff * abs(gn0) or abs(ent - ent0) > 0.02 * abs(ent0) + 1e-3:
            raise RuntimeError(f"self-check failed: first-step grad norm / entropy of {name} ({gn:.6g}, {ent:.6g}) "
                               f"differ from {first_run}'s ({gn0:.6g}, {ent0:.6g})")
    if variants:  # the unprefixed megatron_* numbers (and the ratio) are the best variant's
        best = max(variants, key=lambda v: metrics[f"megatron[{v}]_mfu"])
        metrics["megatron_variant"] = best
        for k in ("step_s", "tokens_per_s", "model_tflops", "mfu", "max_mem_gib", "logprob_mean_abs_diff",
                  "logprob_max_abs_diff"):
            if f"megatron[{best}]_{k}" in metrics:
                metrics[f"megatron_{k}"] = metrics[f"megatron[{best}]_{k}"]

    width = max(len(n) for n, _ in runs)
    print(f"{'backend':{width}} {'step s':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'GiB':>6}   (peak matmul "
          f"{peak:.1f} TFLOP/s, {metrics['params'] / 1e6:.1f}M params, {seq} tokens/seq, {tokens} tokens/step)")
    for name, _ in runs:
        print(f"{name:{width}} {metrics[f'{name}_step_s']:8.3f} {metrics[f'{name}_tokens_per_s']:10.0f} "
              f"{metrics[f'{name}_model_tflops']:8.4g} {metrics[f'{name}_mfu']:6.3f} "
              f"{metrics.get(f'{name}_max_mem_gib', float('nan')):6.1f}")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    result = {
        "name": "train",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{gpu}, torch {torch.__version__}",
        "command": "python bench/train.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "metrics": metrics,
        "ratio": metrics.get("megatron_mfu"),
        "target": 0.40,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
