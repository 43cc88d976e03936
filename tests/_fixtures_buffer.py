"""Helpers for the buffer's tests: sample groups and one local Ray cluster per test module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from buffer.sample import Sample, Status


def make_group(group_index: int, n: int = 4, response_len: int = 6, prompt_len: int = 3,
               version: int = 0, reward: float = 1.0) -> list[Sample]:
    """A valid group of ``n`` samples; tokens encode (group_index, sample) so tests can check identity."""
    return [Sample(group_index=group_index, index=group_index * n + i, prompt=f"p{group_index}", label="7",
                   metadata={"g": group_index}, tokens=[group_index % 1000] * prompt_len + list(range(response_len)),
                   response="r" * response_len, response_length=response_len, loss_mask=[1] * response_len,
                   rollout_log_probs=[-0.5] * response_len, reward=reward, status=Status.COMPLETED,
                   weight_versions=[version]) for i in range(n)]


def ids(groups: list[list[Sample]]) -> list[int]:
    return [g[0].group_index for g in groups]


@pytest.fixture(scope="module")
def ray_local():
    """A real local Ray cluster (loopback only: run the tests under `unshare -n`)."""
    import ray

    tests = Path(__file__).resolve().parent
    # Workers import `buffer` (the repo) and functions defined in test modules (tests/).
    path = os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False, namespace="reservoir-tests", _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        yield ray
    finally:
        ray.shutdown()


def pop_best_reward(args, rollout_id, buffer, num_samples):
    """A --buffer-filter-path plugin (slime's signature): the groups with the highest mean reward."""
    best = sorted(buffer, key=lambda g: -sum(s.reward for s in g) / len(g))[:num_samples]
    for g in best:
        buffer.remove(g)
    for g in best:  # show that the plugin saw the launcher's namespace and the rollout id
        g[0].metadata["seen"] = [args.tag, rollout_id]
    return best
