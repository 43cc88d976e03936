"""FSDP2 (``fully_shard``) across 2 CPU processes over gloo gives the same step as one process:
rank 0's batch is broadcast, each rank trains its share, gradients are reduced, weights gathered.
Opens loopback sockets (gloo): run under the loopback-only namespace, as CI does."""

from __future__ import annotations

import datetime
import math

import pytest
import torch
import torch.multiprocessing as mp

from _fixtures_train import make_groups, settings, weights

# the toy batch (2 optimizer steps); then 3 samples, about 1 per micro-batch: the ranks have
# different numbers of micro-batches and one pads with a zero-weight one
STEPS = ("full", "ragged")


def _batches(groups):
    return {"full": groups, "ragged": [groups[1][:3]]}


def _settings(model_dir):
    # adam_eps >> |grad|: Adam's update ~ lr * grad, so round-off differences stay round-off
    return settings(model_dir, use_kl_loss=True, kl_coef=0.05, global_batch_size=8, lr=0.3, adam_eps=1.0,
                    max_tokens_per_micro_batch=12)


def _worker(rank: int, world: int, store: str, model_dir: str, groups_file: str, out: str) -> None:
    import torch.distributed as dist

    from train_backend import create_backend

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        batches = _batches(torch.load(groups_file, weights_only=False))
        result = {}
        b = create_backend(_settings(model_dir))
        for step, name in enumerate(STEPS):
            metrics = b.train_step(batches[name] if rank == 0 else None, step)
            result[name] = (metrics, weights(b))
        b.save(f"{out}.ckpt")
        b.load(f"{out}.ckpt")
        b.export_hf(f"{out}.hf")
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def test_fsdp2_two_ranks_match_one_process(toy_model_dir, tmp_path):
    from train_backend import create_backend

    groups = make_groups(toy_model_dir, num_groups=2, group_size=8, logp_noise=0.05)
    torch.save(groups, tmp_path / "groups.pt")
    out = tmp_path / "result.pt"
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), str(toy_model_dir), str(tmp_path / "groups.pt"), str(out)),
             nprocs=2, join=True)
    got = torch.load(out, weights_only=False)
    single = create_backend(_settings(toy_model_dir))
    for step, name in enumerate(STEPS):
        m1 = single.train_step(_batches(groups)[name], step)
        m2, w2 = got[name]
        for k in ("train/loss", "train/pg_loss", "train/kl", "train/entropy", "train/grad_norm", "train/num_samples"):
            assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), (name, k)
        w1 = weights(single)
        assert set(w1) == set(w2)
        for k in w1:
            assert torch.allclose(w1[k], w2[k], atol=1e-5), (name, k)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(f"{out}.hf").state_dict()
    assert all(torch.equal(exported[k], got["ragged"][1][k]) for k in exported)
    assert math.isfinite(got["full"][0]["train/tokens_per_s"])
