"""TrainerGroup: the trainer ranks as Ray actors. Two gloo ranks (torch backend, FSDP2) trained
through the group on rank 0's groups end where one rank ends, and a failure inside a rank is one
clear error in the driver. Opens loopback sockets (Ray, gloo): run under `unshare -n`, as CI does."""

from __future__ import annotations

import pytest
import torch

from _fixtures_buffer import ray_local  # noqa: F401  (fixture)
from _fixtures_train import make_groups, settings
from train_backend.actor_group import TrainerGroup, TrainerGroupSettings
from train_backend.megatron.arguments import MegatronSettings


def _settings(model_dir, **kw):
    # as in test_train_fsdp: 2 optimizer steps per rollout, several micro-batches per rank, a KL
    # term; adam_eps >> |grad| keeps Adam's update ~ lr * grad, so round-off stays round-off
    return settings(model_dir, use_kl_loss=True, kl_coef=0.05, global_batch_size=8, lr=0.3, adam_eps=1.0,
                    max_tokens_per_micro_batch=12, **kw)


def _exported(group: TrainerGroup, path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    group.export_hf(str(path))
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_two_gloo_ranks_train_like_one(ray_local, toy_model_dir, tmp_path):  # noqa: F811
    groups = make_groups(toy_model_dir, num_groups=2, group_size=8, logp_noise=0.05)
    one = TrainerGroup(_settings(toy_model_dir))
    two = TrainerGroup(_settings(toy_model_dir), None, TrainerGroupSettings(actor_num_gpus_per_node=2))
    try:
        assert (one.world_size, two.world_size) == (1, 2)
        for step, batch in enumerate([groups, [groups[1][:3]]]):  # then ranks with unequal micro-batches
            m1, m2 = one.train_step(batch, step), two.train_step(batch, step)
            for k in ("train/loss", "train/pg_loss", "train/kl", "train/grad_norm", "train/num_samples"):
                assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), (step, k)
        w1, w2 = _exported(one, tmp_path / "one"), _exported(two, tmp_path / "two")
        assert set(w1) == set(w2)
        for k in w1:
            assert torch.allclose(w1[k], w2[k], atol=1e-5), k
        samples = groups[0][:4]
        lp1, lp2 = one.compute_log_probs(samples), two.compute_log_probs(samples)
        assert [len(x) for x in lp2] == [s.response_length for s in samples]
        assert torch.allclose(torch.tensor(sum(lp1, [])), torch.tensor(sum(lp2, [])), atol=1e-5)
        # a checkpoint written by the 2 ranks loads back into them (each rank reads its own shards)
        two.save(str(tmp_path / "ckpt"))
        two.load(str(tmp_path / "ckpt"))
        # an error inside a rank: one RuntimeError in the driver, naming the rank and the call
        with pytest.raises(RuntimeError, match=r"trainer rank [01]: load failed: RuntimeError: .*not a torch-backend"):
            two.load(str(tmp_path / "no_such_checkpoint"))
    finally:
        one.close()
        two.close()


@pytest.mark.gpu
def test_two_gpu_ranks_get_their_own_gpu_and_train_like_one(ray_local, toy_model_dir, tmp_path):  # noqa: F811
    """On a 2-GPU machine: a placement group gives each rank its own GPU; FSDP2 over NCCL ends
    where one GPU rank ends."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    groups = make_groups(toy_model_dir, num_groups=2, group_size=8, logp_noise=0.05)
    s = _settings(toy_model_dir, device="cuda")
    results = {}
    for n in (1, 2):  # one after the other: the machine has 2 GPUs
        group = TrainerGroup(s, None, TrainerGroupSettings(actor_num_gpus_per_node=n))
        try:
            where = group.placement()
            assert len({tuple(p["gpus"]) for p in where}) == n and all(len(p["gpus"]) == 1 for p in where)
            metrics = [group.train_step(batch, step) for step, batch in enumerate([groups, [groups[1][:3]]])]
            results[n] = metrics, _exported(group, tmp_path / f"gpu{n}")
        finally:
            group.close()
    (m1, w1), (m2, w2) = results[1], results[2]
    for a, b in zip(m1, m2):
        for k in ("train/loss", "train/pg_loss", "train/kl", "train/grad_norm", "train/num_samples"):
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-5), k
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-4), k


@pytest.mark.parametrize("group,train,megatron,msg", [
    (TrainerGroupSettings(1, 3), {"backend": "megatron"}, MegatronSettings(tensor_model_parallel_size=2),
     "3 trainer ranks (--actor-num-nodes 1 x --actor-num-gpus-per-node 3) is not a multiple of "
     "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 1"),
    (TrainerGroupSettings(2, 1), {"device": "cuda:1"}, None, "--train-device cuda:1 pins one device"),
    (TrainerGroupSettings(1, 2), {}, MegatronSettings(pipeline_model_parallel_size=2),
     "--pipeline-model-parallel-size 2 need --train-backend megatron"),
    (TrainerGroupSettings(0, 1), {}, None, "--actor-num-nodes=0 must be >= 1"),
])
def test_bad_layouts_name_the_flags(toy_model_dir, group, train, megatron, msg):
    with pytest.raises(ValueError) as e:
        group.validate(settings(toy_model_dir, **train), megatron)
    assert msg in str(e.value)
