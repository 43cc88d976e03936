"""The torch backend on CUDA: same step as on the CPU, bf16, and FSDP2 over NCCL on 2 GPUs.

    pytest -m gpu tests/test_train_gpu.py
"""

from __future__ import annotations

import datetime
import math

import pytest
import torch
import torch.multiprocessing as mp

from _fixtures_train import make_groups, settings, weights

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _settings(model_dir, **kw):
    kw.setdefault("lr", 0.3)
    kw.setdefault("adam_eps", 1.0)  # Adam's update ~ lr * grad: float differences stay small
    return settings(model_dir, use_kl_loss=True, kl_coef=0.05, global_batch_size=16, **kw)


@needs_cuda
def test_cuda_step_matches_cpu(toy_model_dir):
    from train_backend import create_backend

    groups = make_groups(toy_model_dir, logp_noise=0.05)
    cpu = create_backend(_settings(toy_model_dir))
    gpu = create_backend(_settings(toy_model_dir, device="cuda"))
    m_cpu, m_gpu = cpu.train_step(groups, 0), gpu.train_step(groups, 0)
    for k in ("train/loss", "train/kl", "train/entropy", "train/grad_norm"):
        assert m_gpu[k] == pytest.approx(m_cpu[k], rel=1e-3, abs=1e-5), k
    wc, wg = weights(cpu), weights(gpu)
    assert all(torch.allclose(wc[k], wg[k].cpu(), atol=1e-4) for k in wc)
    lp_cpu = cpu.compute_log_probs(groups[0])
    lp_gpu = gpu.compute_log_probs(groups[0])
    assert max(abs(a - b) for x, y in zip(lp_cpu, lp_gpu) for a, b in zip(x, y)) < 1e-4


@needs_cuda
def test_bf16_trains_without_nan(toy_model_dir):
    from train_backend import create_backend

    groups = make_groups(toy_model_dir, logp_noise=0.05)
    b = create_backend(_settings(toy_model_dir, device="cuda", dtype="bfloat16", lr=1e-3, adam_eps=1e-8))
    for step in range(3):
        m = b.train_step(groups, step)
        assert all(math.isfinite(v) for v in m.values())


def _worker(rank: int, world: int, store: str, model_dir: str, groups_file: str, out: str) -> None:
    import torch.distributed as dist

    from train_backend import create_backend

    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        torch.cuda.set_device(rank)
        b = create_backend(_settings(model_dir, device="cuda"))
        m = b.train_step(torch.load(groups_file, weights_only=False) if rank == 0 else None, 0)
        w = {k: v.cpu() for k, v in weights(b).items()}
        b.save(f"{out}.ckpt")
        b.load(f"{out}.ckpt")
        b.export_hf(f"{out}.hf")
        if rank == 0:
            torch.save((m, w), out)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp2_nccl_two_gpus_match_one(toy_model_dir, tmp_path):
    from train_backend import create_backend

    groups = make_groups(toy_model_dir, logp_noise=0.05)
    torch.save(groups, tmp_path / "groups.pt")
    out = tmp_path / "result.pt"
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), str(toy_model_dir), str(tmp_path / "groups.pt"), str(out)),
             nprocs=2, join=True)
    m2, w2 = torch.load(out, weights_only=False)
    single = create_backend(_settings(toy_model_dir, device="cuda"))
    m1 = single.train_step(groups, 0)
    for k in ("train/loss", "train/kl", "train/entropy", "train/grad_norm"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-3, abs=1e-5), k
    w1 = weights(single)
    assert all(torch.allclose(w1[k].cpu(), w2[k], atol=1e-4) for k in w1)
