"""The buffer actor through a real local Ray cluster (run under `unshare -n`, loopback only)."""

from __future__ import annotations

import argparse
import math
import time

import pytest

from _fixtures_buffer import ids, make_group, ray_local  # noqa: F401  (fixture)
from buffer import BufferSettings, create_buffer, get_buffer


@pytest.fixture
def name(request) -> str:
    return f"buf-{request.node.name}"


def test_found_by_name_from_another_process(ray_local, name):
    ray = ray_local
    h = create_buffer(name, BufferSettings(n_samples_per_prompt=4))

    @ray.remote(num_cpus=0)
    def producer(buffer_name: str, start: int) -> tuple[int, int]:
        import os

        from buffer import get_buffer as find

        b = find(buffer_name)
        return ray.get(b.put.remote([make_group(start), make_group(start + 1)], put_id=f"p{start}")), os.getpid()

    n, pid = ray.get(producer.remote(name, 0))
    assert n == 2 and pid != ray.get(h.ping.remote())
    assert ids(ray.get(get_buffer(name).get.remote(2))) == [0, 1]
    assert create_buffer(name, BufferSettings()) is not None  # get_if_exists: the same actor
    with pytest.raises(ValueError, match="no buffer actor named"):
        get_buffer("nope")


def test_get_waits_for_puts_and_times_out(ray_local, name):
    ray = ray_local
    h = create_buffer(name, BufferSettings())
    pending = h.get.remote(2, timeout_s=30)
    time.sleep(0.3)
    ray.get(h.put.remote([make_group(0)]))
    ready, _ = ray.wait([pending], timeout=0.3)
    assert not ready  # one group is not enough
    ray.get(h.put.remote([make_group(1)]))
    assert ids(ray.get(pending, timeout=10)) == [0, 1]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="0 eligible groups available"):
        ray.get(h.get.remote(1, timeout_s=0.3))
    assert time.monotonic() - t0 < 5


def test_back_pressure(ray_local, name):
    ray = ray_local
    h = create_buffer(name, BufferSettings(capacity=2, put_timeout_s=0.3))
    ray.get(h.put.remote([make_group(0), make_group(1)]))
    with pytest.raises(TimeoutError, match="--buffer-capacity 2"):
        ray.get(h.put.remote([make_group(2)]))
    waiting = h.put.remote([make_group(3)], timeout_s=30)
    time.sleep(0.3)
    assert ray.get(h.size.remote()) == 2
    assert ids(ray.get(h.get.remote(1))) == [0]
    assert ray.get(waiting, timeout=10) == 1
    assert ids(ray.get(h.get.remote(2))) == [1, 3]
    m = ray.get(h.metrics.remote())
    assert m["put_wait_s"] > 0.2 and m["size"] == 0


@pytest.fixture(scope="module")
def shared(ray_local):
    """One actor for the bad-input cases (an actor start costs seconds on a busy 2-core box)."""
    return create_buffer("buf-shared", BufferSettings(n_samples_per_prompt=4))


@pytest.mark.parametrize("kind", ["group_size", "token_lengths", "log_probs", "loss_mask", "nan", "inf",
                                  "missing"])
def test_bad_input_rejected_buffer_keeps_serving(ray_local, shared, kind):
    ray, h = ray_local, shared
    before = ray.get(h.metrics.remote())
    bad = make_group(5)
    s, field = bad[2], {"group_size": "n_samples_per_prompt", "token_lengths": "response_length",
                        "log_probs": "rollout_log_probs", "loss_mask": "loss_mask", "nan": "reward",
                        "inf": "reward", "missing": "weight_versions"}[kind]
    if kind == "group_size":
        bad.append(make_group(5)[0])
    elif kind == "token_lengths":
        s.tokens = s.tokens[:3]
    elif kind == "log_probs":
        s.rollout_log_probs = s.rollout_log_probs + [0.0]
    elif kind == "loss_mask":
        s.loss_mask = s.loss_mask[:-2]
    elif kind in ("nan", "inf"):
        s.reward = math.nan if kind == "nan" else -math.inf
    else:
        s.weight_versions = []
    with pytest.raises(ValueError, match=f"group 1 \\(group_index=5\\).*{field}"):
        ray.get(h.put.remote([make_group(0), bad]))
    assert ray.get(h.size.remote()) == 0  # atomic: the valid group 0 was not stored either
    ray.get(h.put.remote([make_group(1)]))
    assert ids(ray.get(h.get.remote(1))) == [1]
    m = ray.get(h.metrics.remote())
    assert m["rejected_puts"] - before["rejected_puts"] == 1
    assert m["rejected_groups"] - before["rejected_groups"] == 2 and m["puts"] - before["puts"] == 1


def test_staleness_versions_and_metrics(ray_local, name, tmp_path):
    ray = ray_local
    h = create_buffer(name, BufferSettings(max_weight_staleness=0, stale_policy="return",
                                           persist_dir=str(tmp_path)))
    ray.get(h.put.remote([make_group(0, version=0), make_group(1, version=0)]))
    ray.get(h.set_weight_version.remote(1))
    assert ray.get(h.get_weight_version.remote()) == 1 and ray.get(h.size.remote()) == 0
    ray.get(h.put.remote([make_group(2, version=1)]))
    assert ids(ray.get(h.get.remote(1))) == [2]
    assert ids(ray.get(h.take_returned.remote(5))) == [0, 1]
    m = ray.get(h.metrics.remote())
    assert m["returned_stale"] == 2 and m["staleness"] == {"0": 1} and m["bytes_on_disk"] > 0


def test_save_restore_through_the_actor(ray_local, name, tmp_path):
    ray = ray_local
    h = create_buffer(name, BufferSettings())
    ray.get(h.put.remote([make_group(i) for i in range(3)]))
    ray.get(h.get.remote(1, step=1))
    ray.get(h.save.remote(str(tmp_path / "snap")))
    ray.get(h.get.remote(2))
    ray.get(h.restore.remote(str(tmp_path / "snap")))
    assert ray.get(h.size.remote()) == 2
    assert ray.get(h.rewind.remote(0)) == 1
    assert ids(ray.get(h.get.remote(3))) == [0, 1, 2]
    with pytest.raises(ValueError, match="not a buffer snapshot"):
        ray.get(h.restore.remote(str(tmp_path)))


def test_filter_plugin_in_the_actor(ray_local, name):
    ray = ray_local
    h = create_buffer(name, BufferSettings(filter_path="_fixtures_buffer.pop_best_reward"),
                      plugin_args=argparse.Namespace(tag="ns"))
    ray.get(h.put.remote([make_group(i, reward=r) for i, r in enumerate([0.1, 0.9, 0.5, 0.7])]))
    got = ray.get(h.get.remote(2, step=3))
    assert ids(got) == [1, 3] and got[0][0].metadata["seen"] == ["ns", 3]
    assert ids(ray.get(h.get.remote(2))) == [2, 0]


def test_concurrent_producers_and_consumers(ray_local, name):
    """Two producer processes and two concurrent consumers: every group exactly once."""
    ray = ray_local
    h = create_buffer(name, BufferSettings(capacity=6))

    @ray.remote(num_cpus=0)
    def producer(buffer_name: str, base: int) -> int:
        from buffer import get_buffer as find

        b = find(buffer_name)
        for i in range(0, 20, 2):
            ray.get(b.put.remote([make_group(base + i), make_group(base + i + 1)], timeout_s=60))
        return 20

    producers = [producer.remote(name, 0), producer.remote(name, 1000)]
    gets = [h.get.remote(4, timeout_s=60) for _ in range(10)]  # 40 groups, all in flight at once
    batches = [ids(batch) for batch in ray.get(gets, timeout=120)]
    assert ray.get(producers) == [20, 20]
    got = [g for batch in batches for g in batch]
    assert sorted(got) == sorted(list(range(20)) + list(range(1000, 1020)))
    for batch in batches:  # FIFO: within a batch, each producer's groups come in put order
        for base in (0, 1000):
            mine = [g for g in batch if base <= g < base + 20]
            assert mine == sorted(mine)
