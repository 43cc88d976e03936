"""SIGKILL of the buffer actor's process mid-stream: every acknowledged group is trained exactly once.

The producer (a Ray task: another process) puts with put ids and retries a failed put with the
same id; the consumer (this driver, playing the launcher) trains step k on ``get(step=k)``,
"checkpoints" it, then ``commit(k)``; after any failure it resumes from its last checkpoint with
``rewind``. The buffer actor's process is SIGKILLed several times while both run.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from _fixtures_buffer import make_group, ray_local  # noqa: F401  (fixture)
from buffer import BufferSettings, create_buffer, get_buffer

DEADLINE_S = 90.0


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


def produce(name: str, num_puts: int, per_put: int) -> list[int]:
    """Put ``num_puts`` x ``per_put`` groups; returns the group indices that were acknowledged."""
    import ray

    deadline = time.monotonic() + DEADLINE_S
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
