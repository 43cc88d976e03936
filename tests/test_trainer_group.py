"""TrainerGroup: the trainer ranks as Ray actors. Two gloo ranks trained through the group on rank
0's groups (torch backend: FSDP2; Megatron: TP=2) end where one torch rank ends, and a failure
inside a rank is one clear error in the driver. Opens loopback sockets (Ray, gloo): run under `unshare -n`, as CI does."""

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


COMPARED = ("train/loss", "train/pg_loss", "train/kl", "train/grad_norm", "train/num_samples")


def _run(group: TrainerGroup, groups, out) -> dict:
    """Two rollout batches (the second leaves the ranks unequal micro-batch counts), then the
    exported weights and the policy's log-probs."""
    from transformers import AutoModelForCausalLM

    metrics = [group.train_step(batch, step) for step, batch in enumerate([groups, [groups[1][:3]]])]
    group.export_hf(str(out))
    return {"metrics": metrics, "weights": AutoModelForCausalLM.from_pretrained(out).state_dict(),
            "logprobs": group.compute_log_probs(groups[0][:4])}


def _assert_same(ref: dict, got: dict, rel: float = 1e-4, atol: float = 1e-5) -> None:
    for step, (a, b) in enumerate(zip(ref["metrics"], got["metrics"])):
        for k in COMPARED:
            assert b[k] == pytest.approx(a[k], rel=rel, abs=atol / 10), (step, k)
    assert set(got["weights"]) == set(ref["weights"])
    for k, w in ref["weights"].items():
        assert torch.allclose(got["weights"][k], w, atol=atol), k
    assert [len(x) for x in got["logprobs"]] == [len(x) for x in ref["logprobs"]]
    assert torch.allclose(torch.tensor(sum(got["logprobs"], [])), torch.tensor(sum(ref["logprobs"], [])), atol=atol)


@pytest.fixture(scope="module")
def groups(toy_model_dir):
    return make_groups(toy_model_dir, num_groups=2, group_size=8, logp_noise=0.05)


@pytest.fixture(scope="module")
def one_rank(ray_local, toy_model_dir, groups, tmp_path_factory):  # noqa: F811
    """The reference: one torch rank through the same group code."""
    group = TrainerGroup(_settings(toy_model_dir))
    try:
        assert group.world_size == 1
        return _run(group, groups, tmp_path_factory.mktemp("one") / "hf")
    finally:
        group.close()


def test_two_gloo_ranks_train_like_one(ray_local, toy_model_dir, groups, one_rank, tmp_path):  # noqa: F811
    two = TrainerGroup(_settings(toy_model_dir), None, TrainerGroupSettings(actor_num_gpus_per_node=2))
    try:
        assert two.world_size == 2 and [p["rank"] for p in two.placement()] == [0, 1]
        _assert_same(one_rank, _run(two, groups, tmp_path / "hf"))
        # a checkpoint written by the 2 ranks loads back into them (each rank reads its own shards)
        two.save(str(tmp_path / "ckpt"))
        two.load(str(tmp_path / "ckpt"))
        # an error inside a rank: one RuntimeError in the driver, naming the rank and the call
        with pytest.raises(RuntimeError, match=r"trainer rank [01]: load failed: RuntimeError: .*not a torch-backend"):
            two.load(str(tmp_path / "no_such_checkpoint"))
        _train_on_the_buffers_answer(two, groups)
    finally:
        two.close()


class _StubBuffer:
    """The buffer's ``get(n, step=)``: the given groups, or (None) the buffer's timeout."""

    def __init__(self, groups):
        self.groups = groups

    def get(self, n, step=None):
        if self.groups is None:
            raise TimeoutError("buffer.get: 2 groups not there after 0.1s")
        return self.groups[:n]


def _train_on_the_buffers_answer(group: TrainerGroup, groups) -> None:
    """The launcher's sync mode hands rank 0 the buffer's pending answer (``PendingGet``): rank 0
    fetches the groups and the ranks train on them; a failed get fails every rank with the buffer's
    error, and rank 1 is not left waiting in the groups' broadcast."""
    import concurrent.futures

    import ray

    from buffer.retry import PendingGet

    metrics = group.train_step(PendingGet(ray.remote(_StubBuffer).remote(groups), 2, step=2), 2)
    assert metrics["train/num_samples"] == 16 and metrics["perf/buffer_wait_time"] >= 0
    pool = concurrent.futures.ThreadPoolExecutor(1)  # a hang shows as a timeout, not a stuck test
    try:
        call = pool.submit(group.train_step, PendingGet(ray.remote(_StubBuffer).remote(None), 2, step=3), 3)
        with pytest.raises(RuntimeError, match=r"trainer rank [01]: train_step failed: .*no batch .*"
                                               r"get\(step=3\) failed: TimeoutError: buffer.get: 2 groups not there"):
            call.result(timeout=120)
        # rank 1 left the broadcast: it answers the next call (an actor runs one call at a time)
        assert ray.get(group.ranks[1].placement.remote(), timeout=60)["rank"] == 1
    finally:
        pool.shutdown(wait=False)  # (a hung call ends when the finally above closes the group)


def test_megatron_tp2_ranks_train_like_one_torch_rank(ray_local, toy_model_dir, groups, one_rank,  # noqa: F811
                                                      tmp_path):
    """The Megatron backend finds the group's process group (TP=2 over the 2 rank actors) and
    gathers the full weights on rank 0."""
    pytest.importorskip("megatron.core")
    tp2 = TrainerGroup(_settings(toy_model_dir, backend="megatron"), MegatronSettings(tensor_model_parallel_size=2),
                       TrainerGroupSettings(actor_num_gpus_per_node=2))
    try:
        _assert_same(one_rank, _run(tp2, groups, tmp_path / "hf"), atol=2e-5)
    finally:
        tp2.close()


@pytest.mark.gpu
def test_two_gpu_ranks_get_their_own_gpu_and_train_like_one(ray_local, toy_model_dir, groups, tmp_path):  # noqa: F811
    """On a 2-GPU machine: a placement group gives each rank its own GPU; FSDP2 over NCCL ends
    where one GPU rank ends."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = {}
    for n in (1, 2):  # one after the other: the machine has 2 GPUs
        group = TrainerGroup(_settings(toy_model_dir, device="cuda"), None, TrainerGroupSettings(actor_num_gpus_per_node=n))
        try:
            where = group.placement()
            assert len({tuple(p["gpus"]) for p in where}) == n and all(len(p["gpus"]) == 1 for p in where)
            results[n] = _run(group, groups, tmp_path / f"gpu{n}")
        finally:
            group.close()
    _assert_same(results[1], results[2], rel=1e-3, atol=1e-4)


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


def test_cpu_ranks_on_more_nodes_than_the_cluster_has_fail_at_once(ray_local, toy_model_dir):  # noqa: F811
    """--actor-num-nodes 2 on the CPU puts the ranks on two distinct nodes (tests/test_multinode.py
    runs it on a three-node cluster); a one-node cluster says so at once instead of waiting for a
    node that never comes."""
    with pytest.raises(RuntimeError, match="--actor-num-nodes 2 puts the CPU trainer ranks on 2 distinct nodes; "
                                           "the Ray cluster has 1 node"):
        TrainerGroup(settings(toy_model_dir), None, TrainerGroupSettings(actor_num_nodes=2))
