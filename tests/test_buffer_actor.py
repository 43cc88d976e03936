"""The buffer actor through a real local Ray cluster (run under `unshare -n`, loopback only).

One cluster for the whole module (a Ray start costs ~5-15 s on a busy 2-core machine).

The crash test at the end: the producer (a Ray task: another process) puts with put ids and
retries a failed put with the same id; the consumer (this driver, playing the launcher) trains
step k on ``get(step=k)``, "checkpoints" it, then ``commit(k)``; after a failure it resumes from
its last checkpoint with ``rewind``. The buffer actor's process is SIGKILLed several times while
both run; every acknowledged group must be trained exactly once.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import time

import pytest

from _fixtures_buffer import ids, make_group, ray_local  # noqa: F401  (fixture)
from buffer import BufferSettings, create_buffer, get_buffer


DEADLINE_S = 90.0  # a bound on a hang, never a measurement


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


def _until_waiting(ray, h, key: str, n: int) -> None:
    """Return once ``n`` calls wait in the actor (its ``waiting_puts``/``waiting_gets`` gauge)."""
    deadline = time.monotonic() + DEADLINE_S  # a bound on a hang only; the condition is the event
    while ray.get(h.metrics.remote())[key] != n:
        assert time.monotonic() < deadline, f"{key} never reached {n}"
        time.sleep(0.01)


def test_get_waits_for_puts_and_times_out(ray_local, name):
    ray = ray_local
    h = create_buffer(name, BufferSettings())
    pending = h.get.remote(2, timeout_s=DEADLINE_S)
    _until_waiting(ray, h, "waiting_gets", 1)
    ray.get(h.put.remote([make_group(0)]))
    # one group is not enough: the get takes both or nothing, so the group stays queued and it waits on
    m = ray.get(h.metrics.remote())
    assert m["size"] == 1 and m["waiting_gets"] == 1 and m["gets"] == 0
    assert not ray.wait([pending], timeout=0)[0]
    ray.get(h.put.remote([make_group(1)]))
    assert ids(ray.get(pending, timeout=DEADLINE_S)) == [0, 1]
    with pytest.raises(TimeoutError, match="0 eligible groups available"):
        ray.get(h.get.remote(1, timeout_s=0.3))
    m = ray.get(h.metrics.remote())
    assert m["waiting_gets"] == 0 and m["gets"] == 1


def test_back_pressure(ray_local, name):
    ray = ray_local
    h = create_buffer(name, BufferSettings(capacity=2, put_timeout_s=0.3))
    ray.get(h.put.remote([make_group(0), make_group(1)]))
    with pytest.raises(TimeoutError, match="--buffer-capacity 2"):
        ray.get(h.put.remote([make_group(2)]))
    waiting = h.put.remote([make_group(3)], timeout_s=DEADLINE_S)
    _until_waiting(ray, h, "waiting_puts", 1)
    assert ray.get(h.size.remote()) == 2 and not ray.wait([waiting], timeout=0)[0]
    assert ids(ray.get(h.get.remote(1))) == [0]
    assert ray.get(waiting, timeout=DEADLINE_S) == 1
    assert ids(ray.get(h.get.remote(2))) == [1, 3]
    m = ray.get(h.metrics.remote())
    assert m["waiting_puts"] == 0 and m["put_wait_s"] > 0 and m["size"] == 0 and m["puts"] == 2


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


def test_commit_returns_the_metrics_after_it_when_asked(ray_local, name):
    """The launcher without --save commits each step and logs the buffer's metrics in one call."""
    ray = ray_local
    h = create_buffer(name, BufferSettings())
    ray.get(h.put.remote([make_group(0), make_group(1)], put_id="p0"))
    ray.get(h.get.remote(2, step=0))
    assert ray.get(h.metrics.remote())["leased_groups"] == 2
    assert ray.get(h.commit.remote(0, cover_known=True)) is None
    ray.get(h.put.remote([make_group(2)], put_id="p1"))
    ray.get(h.get.remote(1, step=1))
    m = ray.get(h.commit.remote(1, cover_known=True, return_metrics=True))
    assert m == ray.get(h.metrics.remote()) and m["leased_groups"] == 0 and m["commits"] == 2


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


# --- crash: SIGKILL of the actor's process ------------------------------------------------


def _retry(fn, what: str, deadline: float):
    """Call ``fn`` until the (restarting) actor answers; actor errors only, never others."""
    import ray

    while True:
        try:
            return fn()
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: the buffer actor did not come back") from None
            time.sleep(0.2)


def produce(name: str, num_puts: int, per_put: int, limit_s: float = DEADLINE_S) -> list[int]:
    """Put ``num_puts`` x ``per_put`` groups; returns the group indices that were acknowledged."""
    import ray

    deadline = time.monotonic() + limit_s
    h = get_buffer(name)
    acked: list[int] = []
    for p in range(num_puts):
        batch = [make_group(p * per_put + j) for j in range(per_put)]
        n = _retry(lambda: ray.get(h.put.remote(batch, put_id=f"put-{p}", timeout_s=30)), f"put {p}", deadline)
        assert n == per_put
        acked += [g[0].group_index for g in batch]
        time.sleep(0.01)
    return acked


def _kill(h) -> int:
    import ray

    pid = ray.get(h.ping.remote())
    os.kill(pid, signal.SIGKILL)
    return pid


def test_sigkill_mid_stream_exactly_once(ray_local, tmp_path):
    ray = ray_local
    name = "buf-crash"
    h = create_buffer(name, BufferSettings(n_samples_per_prompt=4, capacity=12, persist_dir=str(tmp_path)))
    num_puts, per_put, per_step = 24, 2, 4
    producer = ray.remote(num_cpus=0)(produce).remote(name, num_puts, per_put)
    deadline = time.monotonic() + DEADLINE_S
    trained: dict[int, list[int]] = {}  # the trainer's checkpoints: step -> group indices
    kill_at = {2: "after_get", 5: "after_checkpoint", 8: "before_get"}
    killed: list[int] = []
    step = 1
    while step <= num_puts * per_put // per_step:
        if kill_at.get(step) == "before_get" and step not in killed:
            killed.append(step), _kill(h)
        try:
            groups = ray.get(h.get.remote(per_step, timeout_s=30, step=step))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            # the launcher resumes from its last checkpoint: leases of later steps come back
            _retry(lambda: ray.get(h.rewind.remote(step - 1)), "rewind", deadline)
            continue
        if kill_at.get(step) == "after_get" and step not in killed:
            killed.append(step), _kill(h)  # the trainer crashed too: this step never happened
            _retry(lambda: ray.get(h.rewind.remote(step - 1)), "rewind", deadline)
            continue
        trained[step] = [g[0].group_index for g in groups]  # the checkpoint of `step` is durable
        if kill_at.get(step) == "after_checkpoint" and step not in killed:
            killed.append(step), _kill(h)
        _retry(lambda: ray.get(h.commit.remote(step)), "commit", deadline)  # idempotent: retry
        step += 1
    acked = ray.get(producer, timeout=DEADLINE_S)
    flat = [g for s in sorted(trained) for g in trained[s]]
    assert len(killed) == 3
    assert sorted(flat) == sorted(acked) == list(range(num_puts * per_put))  # nothing lost, no duplicates
    assert ray.get(h.size.remote()) == 0
    m = ray.get(h.metrics.remote())
    assert m["leased_groups"] == 0 and m["bytes_on_disk"] > 0
    assert ray.get(h.ping.remote()) not in killed


def test_restart_from_disk_in_a_new_actor(ray_local, tmp_path):
    """A whole-job crash: a new actor (new name, new job) pointed at the same --buffer-dir."""
    ray = ray_local
    h = create_buffer("buf-a", BufferSettings(persist_dir=str(tmp_path)))
    ray.get(h.put.remote([make_group(i) for i in range(5)], put_id="x"))
    ray.get(h.get.remote(2, step=1))
    ray.get(h.commit.remote(1))
    ray.get(h.get.remote(2, step=2))  # step 2 never checkpointed
    ray.kill(h, no_restart=True)
    h2 = create_buffer("buf-b", BufferSettings(persist_dir=str(tmp_path)))
    assert ray.get(h2.put.remote([make_group(0)], put_id="x")) == 5  # the retry is recognised
    assert ray.get(h2.rewind.remote(1)) == 2
    assert [g[0].group_index for g in ray.get(h2.get.remote(3))] == [2, 3, 4]
    with pytest.raises(TimeoutError):
        ray.get(h2.get.remote(1, timeout_s=0.2))


@pytest.mark.slow
def test_sigkill_at_random_times_exactly_once(ray_local, tmp_path):
    """Like the test above, with a thread SIGKILLing the actor at random moments (slow: ~1 min)."""
    import random
    import threading

    ray = ray_local
    name = "buf-crash-random"
    h = create_buffer(name, BufferSettings(n_samples_per_prompt=4, capacity=8, persist_dir=str(tmp_path)))
    num_puts, per_put, per_step = 150, 2, 4
    producer = ray.remote(num_cpus=0)(produce).remote(name, num_puts, per_put, 3 * DEADLINE_S)
    deadline = time.monotonic() + 3 * DEADLINE_S
    stop, kills = threading.Event(), []

    def killer() -> None:
        rng = random.Random(0)
        while not stop.wait(rng.uniform(0.3, 1.5)):
            try:
                kills.append(_kill(h))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                pass  # restarting right now

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    trained: dict[int, list[int]] = {}
    step = 1
    try:
        while step <= num_puts * per_put // per_step:
            try:
                groups = ray.get(h.get.remote(per_step, timeout_s=60, step=step))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                _retry(lambda: ray.get(h.rewind.remote(step - 1)), "rewind", deadline)
                continue
            trained[step] = [g[0].group_index for g in groups]
            _retry(lambda: ray.get(h.commit.remote(step)), "commit", deadline)
            step += 1
    finally:
        stop.set()
        thread.join(timeout=10)
    acked = ray.get(producer, timeout=3 * DEADLINE_S)
    flat = [g for s in sorted(trained) for g in trained[s]]
    print(f"{len(kills)} SIGKILLs")
    assert len(kills) >= 3
    assert sorted(flat) == sorted(acked) == list(range(num_puts * per_put))
