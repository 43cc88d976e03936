"""Shared helpers for the Megatron backend tests: tiny HF checkpoints and a multi-process runner.

The checks that run inside spawned ranks live here (not in the test files) so that
``torch.multiprocessing`` can import them by module path.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

VOCAB = 100  # not a multiple of 128: exercises vocabulary padding


def hf_config(arch: str) -> Any:
    """Tiny configs: hidden 64, 2 layers, GQA (4 heads / 2 KV heads)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if arch == "llama":  # untied, llama3 rope scaling, unusual eps
        return LlamaConfig(**common, tie_word_embeddings=False, rms_norm_eps=1e-5,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 128})
    if arch == "qwen2":  # tied, QKV bias, linear rope scaling
        return Qwen2Config(**common, tie_word_embeddings=True, rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0})
    if arch == "qwen3":  # untied, q/k norm, head_dim != hidden / heads
        return Qwen3Config(**common, head_dim=24, tie_word_embeddings=False, rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise ValueError(arch)


ARCHS = ("llama", "qwen2", "qwen3")


def make_hf_checkpoint(arch: str, out: Path, seed: int = 0) -> Path:
    """Save a tiny random fp32 HF model of ``arch`` to ``out``; biases/norms are randomised too
    (zero biases and unit norms would hide conversion mistakes)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    return out


# --------------------------------------------------------------------------------- spawning
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        result: Any = ("ok", fn(*args))
    except BaseException:  # reported to the parent test, which fails with the traceback
        result = ("error", traceback.format_exc())
    tmp_file = os.path.join(out_dir, f".rank{rank}.pkl")
    with open(tmp_file, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp_file, os.path.join(out_dir, f"rank{rank}.pkl"))  # atomic: the parent polls
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _first_error(tmp: Path, world: int) -> str | None:
    for r in range(world):
        f = tmp / f"rank{r}.pkl"
        if f.exists():
            try:
                with open(f, "rb") as fh:
                    status, value = pickle.load(fh)
            except (EOFError, pickle.UnpicklingError):  # still being written
                continue
            if status != "ok":
                return value
    return None


def spawn(fn: Callable, world: int, args: tuple, tmp: Path, timeout_s: float = 240.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` gloo ranks (loopback); return each rank's result.

    Fails (RuntimeError with the rank's traceback) if a rank raised, died or timed out.
    """
    import torch.multiprocessing as mp

    tmp.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_entry, args=(world, _free_port(), fn, args, str(tmp)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if _first_error(tmp, world) is not None:
                break  # the other ranks would wait for the failed one in a collective
            if time.monotonic() > deadline:
                raise RuntimeError(f"spawned ranks did not finish within {timeout_s}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    error = _first_error(tmp, world)
    if error is not None:
        raise RuntimeError(f"a rank failed:\n{error}")
    results = []
    for r in range(world):
        with open(tmp / f"rank{r}.pkl", "rb") as f:
            status, value = pickle.load(f)
        if status != "ok":
            raise RuntimeError(f"rank {r} failed:\n{value}")
        results.append(value)
    return results


# ----------------------------------------------------------------------- checks run in ranks
def check_layouts(ckpt_dirs: dict[str, str], layouts: list[tuple[int, int]], device: str = "cpu") -> dict[str, Any]:
    """:func:`check_equivalence` for each ``(tp, pp)`` layout in turn, in one job (saves the
    start-up of a process group per layout)."""
    return {f"tp{tp}pp{pp}": check_equivalence(ckpt_dirs, tp, pp, device) for tp, pp in layouts}


def check_equivalence(ckpt_dirs: dict[str, str], tp: int, pp: int, device_name: str = "cpu") -> dict[str, dict[str, float]]:
    """For each checkpoint: build the model on this layout, load it, compare logits and
    engine-style log-probs with HF, and export(load(ckpt)) with the checkpoint.

    Returns per arch ``{"logits": max abs diff, "logprobs": ..., "export_equal": 0/1}`` on the
    ranks that computed them (last stage for logits, rank 0 for export).
    """
    from megatron.core import parallel_state
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from train_backend.megatron import checkpoint, cpu_compat, forward, model as mmodel, parallel

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for a 1e-4 comparison
        torch.backends.cudnn.allow_tf32 = False
    results: dict[str, dict[str, float]] = {}
    with cpu_compat.maybe_cpu_mode(device):
        parallel.init_distributed(device)
        parallel.init_parallel_state(tp, pp, seed=1, device=device)
        for arch, path in ckpt_dirs.items():
            cfg = AutoConfig.from_pretrained(path)
            dims = mmodel.dims_from_hf(cfg, 128, tp)
            tcfg = mmodel.transformer_config(dims, params_dtype=torch.float32, tp_size=tp, pp_size=pp,
                                             sequence_parallel=False, on_cpu=device.type == "cpu")
            model = mmodel.build_gpt_model(dims, tcfg, cfg).to(device)
            checkpoint.load_hf_weights(model, checkpoint.HFCheckpointReader(path), dims)
            model.eval()
            torch.manual_seed(7)
            seqs = [torch.randint(0, VOCAB, (n,)).tolist() for n in (13, 9, 16, 5)]
            mbs = forward.make_micro_batches(seqs, max_tokens=32, device=device)
            temp = 0.7

            def loss_fn(mb: forward.MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
                lp = forward.token_log_probs(logits, mb.tokens, dims.vocab_size, temp)  # [b, T-1]
                return logits.sum() * 0, {"logits": forward.gather_vocab(logits, dims.vocab_size),
                                          "logprobs": lp, "rows": mb.rows, "lengths": mb.lengths}

            with torch.no_grad():
                out = forward.run_pipeline([model], mbs, loss_fn, forward_only=True)
            res: dict[str, float] = {}
            if parallel_state.is_pipeline_last_stage():
                hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
                d_logits = d_lp = 0.0
                for st in out:
                    for r, (row, n) in enumerate(zip(st["rows"], st["lengths"])):
                        if row < 0:
                            continue
                        ids = torch.tensor([seqs[row]], device=device)
                        with torch.no_grad():
                            ref = hf(ids).logits[0]  # [n, V]
                        ref_lp = torch.log_softmax(ref[:-1] / temp, -1).gather(-1, ids[0, 1:, None])[:, 0]
                        d_logits = max(d_logits, (st["logits"][r, :n] - ref).abs().max().item())
                        d_lp = max(d_lp, (st["logprobs"][r, : n - 1] - ref_lp).abs().max().item())
                res.update(logits=d_logits, logprobs=d_lp)
            exported = dict(checkpoint.iter_hf_weights(model, dims))
            if torch.distributed.get_rank() == 0:
                orig = load_file(os.path.join(path, "model.safetensors"))
                same = sorted(exported) == sorted(orig) and all(
                    torch.equal(exported[k].cpu(), orig[k]) and exported[k].dtype == orig[k].dtype for k in orig)
                res["export_equal"] = float(same)
            results[arch] = res
        parallel.destroy_parallel_state()
    return results


# ------------------------------------------------------------------------- backend training
def make_groups(seed: int, num_groups: int = 2, n: int = 4) -> list:
    """Random but valid groups of Samples over the toy model's vocabulary (ids 7..59)."""
    import random

    from buffer.sample import Sample, Status

    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        prompt = [rng.randrange(7, 60) for _ in range(rng.randrange(3, 8))]
        group = []
        for i in range(n):
            r = rng.randrange(2, 9)
            group.append(Sample(group_index=g, index=g * n + i, tokens=prompt + [rng.randrange(7, 60) for _ in range(r)],
                                response_length=r, loss_mask=[1] * (r - 1) + [rng.randrange(2)],
                                rollout_log_probs=[-rng.random() * 3 for _ in range(r)],
                                reward=float(rng.random()), status=Status.COMPLETED, weight_versions=[0]))
        out.append(group)
    return out


def train_settings(ckpt: str, **kw: Any) -> Any:
    """The settings both backends are compared under: KL, entropy, TIS, two optimizer steps."""
    from train_backend.interfaces import TrainSettings

    base = dict(hf_checkpoint=ckpt, lr=1e-3, use_kl_loss=True, kl_coef=0.1, entropy_coef=0.01, use_tis=True,
                global_batch_size=4, max_tokens_per_micro_batch=40, seed=3)
    base.update(kw)
    return TrainSettings(**base)


def run_layouts(ckpt: str, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`run_megatron` for each job's keyword arguments in turn, in one process group."""
    from train_backend.megatron import parallel

    out = []
    for kw in jobs:
        out.append(run_megatron(ckpt, **kw))
        parallel.destroy_parallel_state()
    return out


def run_megatron(ckpt: str, megatron_kw: dict, steps: int, save_dir: str | None = None,
                 export_dir: str | None = None, settings_kw: dict | None = None) -> dict[str, Any]:
    """Train ``steps`` rollout batches with the Megatron backend on this rank; rank 0 returns
    metrics, HF weights and log-probs. With ``save_dir``: save after step 0, then after the last
    step reload and repeat steps 1.. to check the restart is exact (``replay_*``)."""
    from train_backend.megatron import create_megatron_backend
    from train_backend.megatron.arguments import MegatronSettings

    settings = train_settings(ckpt, **(settings_kw or {}))
    if settings.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = False
    backend = create_megatron_backend(settings, MegatronSettings(**megatron_kw))
    metrics = []
    for step in range(steps):
        metrics.append(backend.train_step(make_groups(step) if torch.distributed.get_rank() == 0 else None, step))
        if step == 0 and save_dir is not None:
            backend.save(save_dir)
    out: dict[str, Any] = {"metrics": metrics, "weights": {k: v.detach().cpu().clone() for k, v in backend.named_hf_weights()},
                           "logprobs": backend.compute_log_probs([s for g in make_groups(99) for s in g])}
    if save_dir is not None:
        backend.load(save_dir)
        out["replay_metrics"] = [backend.train_step(make_groups(step) if torch.distributed.get_rank() == 0 else None,
                                                    step) for step in range(1, steps)]
        out["replay_weights"] = {k: v.detach().cpu().clone() for k, v in backend.named_hf_weights()}
    if export_dir is not None:
        backend.export_hf(export_dir)
    return out



def bf16_moves(ckpt: str, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each job (``dtype``, ``use_distributed_optimizer``): how far the fp32 master weights are
    from the checkpoint's values (in megatron's layout, vocabulary padding included) right after
    start-up, and which fraction of the bf16 weights the engines get (the HF weights cast to bf16)
    one small optimizer step changes."""
    from train_backend.megatron import create_megatron_backend, parallel
    from train_backend.megatron.arguments import MegatronSettings
    from train_backend.megatron.checkpoint import HFCheckpointReader, _hf_shards, _master_slices

    out = []
    for job in jobs:
        # lr 2e-6 (the SmolLM2 example's): Adam's first step moves each weight by ~lr
        settings = train_settings(ckpt, dtype=job["dtype"], lr=2e-6, use_kl_loss=False, kl_coef=0.0,
                                  entropy_coef=0.0, use_tis=False)
        backend = create_megatron_backend(settings, MegatronSettings(
            use_distributed_optimizer=job["use_distributed_optimizer"]))
        masters = _master_slices(backend.optimizer)
        gaps = []
        for param, shard in _hf_shards(backend.model, HFCheckpointReader(ckpt), backend.dims):
            if id(param) in masters:
                main, start, end = masters[id(param)]
                gaps.append(float((main - shard.reshape(-1)[start:end].view_as(main)).abs().max()))
        before = {k: v.detach().to(torch.bfloat16).clone() for k, v in backend.named_hf_weights()}
        backend.train_step(make_groups(0), 0)
        after = {k: v.detach().to(torch.bfloat16) for k, v in backend.named_hf_weights()}
        changed = sum(int((after[k] != before[k]).sum()) for k in before)
        out.append({**job, "masters": len(gaps), "master_gap": max(gaps, default=None),
                    "changed": changed / sum(v.numel() for v in before.values())})
        parallel.destroy_parallel_state()
    return out
