"""Persistence without Ray: recovery after a crash, torn writes, space reclaim, save/restore."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from _fixtures_buffer import ids, make_group
from buffer.core import BufferCore
from buffer.interfaces import BufferSettings
from buffer.store import SegmentStore, read_generation, write_generation


def open_core(d: Path, store_kw: dict | None = None, **kw) -> tuple[BufferCore, SegmentStore]:
    """What the actor's __init__ does: open the store, replay it into a fresh core."""
    settings = BufferSettings(persist_dir=str(d), **kw)
    store = SegmentStore(d, fsync=settings.fsync, **(store_kw or {}))
    c = BufferCore(settings, journal=store)
    c.recover(*store.load())
    return c, store


def state(c: BufferCore) -> dict:
    r = c.state_record()
    return {k: r[k] for k in ("version", "queue", "returned", "leases", "taken")}


def test_recovery_reproduces_acknowledged_state(tmp_path):
    c, _ = open_core(tmp_path, max_weight_staleness=2, stale_policy="return")
    c.put([make_group(i) for i in range(4)], put_id="a")
    c.put([make_group(i) for i in range(4, 8)], put_id="b")
    c.try_get(2, step=1)
    c.try_get(2, step=2)
    c.commit(1)
    c.try_get(1)  # consumed for good
    c.rewind(1)  # step 2's groups back to the front
    c.set_version(3)  # version-0 groups are 3 behind: returned
    c.put([make_group(8, version=3)], put_id="c")
    c.try_get(1, step=2)
    before = state(c)
    # "crash": nothing is closed; a new process opens the directory
    c2, _ = open_core(tmp_path, max_weight_staleness=2, stale_policy="return")
    assert state(c2) == before
    assert c2.duplicate("b") == 4 and c2.duplicate("c") == 1  # retried puts stay idempotent
    assert ids(c2.take_returned(10)) == [2, 3, 5, 6, 7]
    assert c2.rewind(1) == 1 and ids(c2.try_get(1)) == [8]
    c3, _ = open_core(tmp_path, max_weight_staleness=2, stale_policy="return")
    assert c3.size() == 0 and c3.take_returned(10) == [] and c3.version == 3


def test_torn_segment_tail_and_torn_log_line(tmp_path):
    c, store = open_core(tmp_path)
    c.put([make_group(0)], put_id="a")
    c.put([make_group(1)], put_id="b")
    c.try_get(1, step=1)
    seg = next(store.directory.glob("seg-*.arrows"))
    with open(seg, "ab") as f:  # a put that died mid-write (never acknowledged)
        f.write(b"\xff\xff\xff\xff\x10\x00\x00\x00garbage")
    with open(store.directory / "log.jsonl", "ab") as f:
        f.write(b'{"op":"commit","st')  # a record that died mid-write (never applied)
    c2, store2 = open_core(tmp_path)
    assert state(c2)["queue"] == [1] and state(c2)["leases"] == {"1": [0]}
    assert (store2.directory / "log.jsonl").read_bytes().endswith(b"\n")  # torn line cut off
    c2.put([make_group(2)])  # goes to a new segment, never after the torn tail
    c2.commit(1)
    c3, _ = open_core(tmp_path)
    assert ids(c3.try_get(2)) == [1, 2] and c3.as_metrics()["leased_groups"] == 0


def test_files_are_arrow_readable_and_lossless(tmp_path):
    c, store = open_core(tmp_path)
    g = make_group(5)
    g[0].reward = {"acc": 1.0, "fmt": 0.5}
    g[1].prompt = [{"role": "user", "content": "2+2 = ? ünïcode"}]
    c.put([g], put_id="x")
    seg = next(store.directory.glob("seg-*.arrows"))
    table = pa.ipc.open_stream(pa.OSFile(str(seg))).read_all()
    assert table.num_rows == 4 and set(table.column("_put_id").to_pylist()) == {"x"}
    c2, _ = open_core(tmp_path)
    assert c2.try_get(1) == [g]


def test_consumed_segments_are_deleted_and_bytes_tracked(tmp_path):
    c, store = open_core(tmp_path, store_kw={"segment_bytes": 1})  # every put closes its segment
    for i in range(6):
        c.put([make_group(i, response_len=200)])
    assert len(list(store.directory.glob("seg-*"))) == 6
    on_disk = c.as_metrics()["bytes_on_disk"]
    assert on_disk == sum(p.stat().st_size for p in store.directory.iterdir())
    c.try_get(2, step=1)
    assert len(list(store.directory.glob("seg-*"))) == 6  # leased, not final: kept
    c.commit(1)
    c.try_get(3)
    assert len(list(store.directory.glob("seg-*"))) == 1
    assert c.as_metrics()["bytes_on_disk"] < on_disk / 3
    c2, _ = open_core(tmp_path)
    assert ids(c2.try_get(1)) == [5]


def test_put_ids_survive_the_deletion_of_their_segment(tmp_path):
    kw = {"segment_bytes": 1}
    c, store = open_core(tmp_path, store_kw=kw)
    c.put([make_group(0), make_group(1)], put_id="a")
    c.put([make_group(2)], put_id="b")
    c.try_get(3)
    assert not list(store.directory.glob("seg-*"))  # all consumed: the bytes are gone
    c2, _ = open_core(tmp_path, store_kw=kw)
    assert c2.duplicate("a") == 2 and c2.duplicate("b") == 1  # a late retry is still recognised


def test_log_compaction_keeps_state(tmp_path):
    kw = {"log_compact_bytes": 300}
    c, store = open_core(tmp_path, store_kw=kw)
    c.put([make_group(i) for i in range(10)], put_id="p")
    for step in range(1, 9):
        c.try_get(1, step=step)
        c.commit(step - 1)
    c.rewind(6)
    log_size = (store.directory / "log.jsonl").stat().st_size
    assert log_size < 900  # compacted at least once: one state record plus a few lines
    before = state(c)
    c2, _ = open_core(tmp_path, store_kw=kw)
    assert state(c2) == before and c2.duplicate("p") == 10


def test_rewrite_generation_when_live_data_is_sparse(tmp_path):
    kw = {"segment_bytes": 10 << 20, "compact_min_bytes": 20_000, "compact_factor": 3.0}
    c, store = open_core(tmp_path, store_kw=kw, max_weight_staleness=0, stale_policy="return")
    c.put([make_group(0, response_len=300)])  # will be returned (stale) and pin the segment
    c.set_version(1)
    for i in range(1, 12):
        c.put([make_group(i, response_len=300, version=1)])
        c.try_get(1)
    assert store.directory.name != "gen-000000"  # compacted into a new generation
    assert len(list(tmp_path.glob("gen-*"))) == 1
    # without compaction 12 groups would be on disk; it stays near factor x the one live group
    assert c.as_metrics()["bytes_on_disk"] <= 4 * store._live_bytes
    c.put([make_group(12, version=1)])
    c2, _ = open_core(tmp_path, store_kw=kw, max_weight_staleness=0, stale_policy="return")
    assert ids(c2.take_returned(5)) == [0] and ids(c2.try_get(1)) == [12]


def test_save_and_restore(tmp_path):
    c, _ = open_core(tmp_path / "live")
    c.put([make_group(i) for i in range(5)], put_id="a")
    c.try_get(2, step=1)
    c.set_version(4)
    write_generation(tmp_path / "snap", c, fsync=False)
    before = state(c)
    c.try_get(3)
    c.put([make_group(9)])
    c.replace_with(*read_generation(tmp_path / "snap"))
    assert state(c) == before
    c2, _ = open_core(tmp_path / "live")  # the restore was persisted
    assert state(c2) == before and c2.version == 4
    assert c2.rewind(0) == 2 and ids(c2.try_get(5)) == [0, 1, 2, 3, 4]
    mem = BufferCore(BufferSettings())  # restore into a buffer without persistence
    mem.replace_with(*read_generation(tmp_path / "snap"))
    assert state(mem) == before


def test_write_error_stops_the_store(tmp_path):
    c, store = open_core(tmp_path)
    c.put([make_group(0)])
    store._log_fd_saved = store._log_fd
    import os

    os.close(store._log_fd)  # the next log write fails with EBADF
    with pytest.raises(OSError):
        c.try_get(1)
    assert c.size() == 1  # nothing changed in memory
    with pytest.raises(RuntimeError, match="restart the buffer"):
        c.put([make_group(1)])
    c2, _ = open_core(tmp_path)
    assert ids(c2.try_get(1)) == [0]


def test_fsync_mode_roundtrip(tmp_path):
    c, _ = open_core(tmp_path, fsync=True)
    c.put([make_group(0)], put_id="a")
    c.try_get(1, step=3)
    c2, _ = open_core(tmp_path, fsync=True)
    assert json.loads(json.dumps(state(c2))) == {"version": 0, "queue": [], "returned": [], "leases": {"3": [0]}, "taken": {}}


def test_one_process_per_directory(tmp_path):
    c, store = open_core(tmp_path)
    c.put([make_group(0)])
    root = Path(__file__).resolve().parents[1]
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); from buffer.store import SegmentStore\n"
             "try:\n    SegmentStore(sys.argv[2], lock_wait_s=0.2)\nexcept RuntimeError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", probe, str(root), str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert "is in use by another buffer process" in out.stdout, out.stderr
    store.close()  # released: another process may take over
    out = subprocess.run([sys.executable, "-c", probe, str(root), str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout == "", out.stderr


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_recover_exactly(tmp_path, seed):
    """A model check: a persistent core and an in-memory twin see the same random operations; the
    persistent one is reopened ("crashes") now and then and must always match its twin."""
    import random

    rng = random.Random(seed)
    kw = {"segment_bytes": rng.choice([1, 3000, 1 << 20]), "log_compact_bytes": rng.choice([200, 1 << 20]),
          "compact_min_bytes": 5000, "compact_factor": 2.0}
    settings = {"capacity": 1000, "max_weight_staleness": rng.choice([None, 0, 2]),
                "stale_policy": rng.choice(["drop", "return"])}
    disk, store = open_core(tmp_path, store_kw=kw, **settings)
    twin = BufferCore(BufferSettings(**settings))
    version, step, gid = 0, 0, 0
    for i in range(300):
        op = rng.random()
        if op < 0.35:
            n = rng.randint(1, 3)
            groups = [make_group(gid + j, version=max(0, version - rng.randint(0, 3))) for j in range(n)]
            gid += n
            for c in (disk, twin):
                c.put([[s.copy() for s in g] for g in groups], put_id=f"p{i}")
        elif op < 0.55:
            n, s = rng.randint(1, 3), rng.choice([None, step + 1])
            step = s if s is not None else step
            assert ids(disk.try_get(n, s) or []) == ids(twin.try_get(n, s) or [])
        elif op < 0.65:
            k = rng.randint(0, step)
            covered = [r for r in twin.state_record()["taken"] if rng.random() < 0.5]
            disk.commit(k, covered), twin.commit(k, covered)
        elif op < 0.72:
            k = rng.randint(0, step)
            assert disk.rewind(k) == twin.rewind(k)
        elif op < 0.8:
            version += rng.randint(0, 1)
            disk.set_version(version), twin.set_version(version)
        elif op < 0.87:
            n, request = rng.randint(0, 2), rng.choice([None, f"r{i}"])
            assert ids(disk.take_returned(n, request)) == ids(twin.take_returned(n, request))
        else:
            store.close() if rng.random() < 0.5 else None  # a clean stop, or a "crash" (nothing closed)
            disk, store = open_core(tmp_path, store_kw=kw, **settings)
        assert state(disk) == state(twin), f"op {i}"
    on_disk = sum(p.stat().st_size for p in store.directory.iterdir())
    assert disk.as_metrics()["bytes_on_disk"] == on_disk


def test_unstorable_values_are_rejected_and_the_store_keeps_serving(tmp_path):
    c, _ = open_core(tmp_path)
    bad = make_group(1)
    bad[0].metadata = {"x": {1, 2}}  # a set: not JSON
    with pytest.raises(ValueError, match="cannot be stored as Arrow"):
        c.put([make_group(0), bad], put_id="a")
    assert c.size() == 0 and c.duplicate("a") is None and c.as_metrics()["rejected_by_field"] == {"not_storable": 1}
    c.put([make_group(2)], put_id="b")
    c2, _ = open_core(tmp_path)
    assert ids(c2.try_get(1)) == [2]


def test_forgotten_put_ids_replay_and_regenerated_puts_stay_known(tmp_path):
    """The forget record of a rewind replays after a crash; a put made again under a forgotten
    id after it is still recognised as a duplicate after the next crash."""
    c, _ = open_core(tmp_path)
    c.put([make_group(0)], put_id="rollout-0")
    c.put([make_group(1, version=2)], put_id="rollout-1")
    c.set_version(2)
    c.rewind(-1, weight_version=1, forget_put_ids=["rollout-1"])
    c, _ = open_core(tmp_path)  # crash after the rewind
    assert (c.version, c.known_put_ids(), ids(c.try_get(1))) == (1, ["rollout-0"], [0])
    c.put([make_group(11, version=1)], put_id="rollout-1")
    c, _ = open_core(tmp_path)  # crash after the regenerated put
    assert c.duplicate("rollout-1") == 1
    assert ids(c.try_get(1)) == [11]


def test_take_returned_retried_with_its_request_id_gets_the_same_groups_after_a_crash(tmp_path):
    """The rollout manager retries ``take_returned`` across a buffer restart: a call whose answer was
    lost (the buffer died after journaling it) gets the same groups from the recovered buffer, and
    a new request id gets the rest."""
    c, _ = open_core(tmp_path, max_weight_staleness=0, stale_policy="return")
    c.put([make_group(i) for i in range(3)])
    c.set_version(1)  # all three stale: set aside for regeneration
    assert ids(c.take_returned(2, request_id="rollout-7")) == [0, 1]
    assert ids(c.take_returned(2, request_id="rollout-7")) == [0, 1]  # a retry, same process
    c2, _ = open_core(tmp_path, max_weight_staleness=0, stale_policy="return")  # the crash: replay the journal
    assert ids(c2.take_returned(2, request_id="rollout-7")) == [0, 1]
    assert c2.as_metrics()["taken_returned"] == 0  # handed out once, before the crash
    assert ids(c2.take_returned(2, request_id="rollout-8")) == [2]
    assert ids(c2.take_returned(2)) == []


@pytest.mark.parametrize("compact", [False, True])
def test_returned_groups_taken_stay_the_buffers_until_a_checkpoint_covers_their_put(tmp_path, compact):
    """--stale-policy return across a driver crash: groups handed out for regeneration by rollout 8
    are final only once a commit names ``rollout-8`` covered. A crash of the driver before that
    (--load: rewind) gives them back, first in line, and the regenerated rollout 8 takes them again
    (not its cached answer); a buffer crash in between (with or without a compaction of the
    journal, which writes the takes into its state record) keeps all of it."""
    store_kw = {"log_compact_bytes": 1} if compact else None  # compact at every record
    c, _ = open_core(tmp_path, store_kw, max_weight_staleness=0, stale_policy="return")
    c.put([make_group(i) for i in range(4)], put_id="rollout-6")
    c.set_version(1)  # all stale: set aside
    assert ids(c.take_returned(2, request_id="rollout-7")) == [0, 1]
    c.commit(6, covered_put_ids=["rollout-6", "rollout-7"])  # the checkpoint covers rollout 7's put
    assert ids(c.take_returned(2, request_id="rollout-8")) == [2, 3]
    assert c.as_metrics()["taken_uncovered_groups"] == 2
    c, _ = open_core(tmp_path, store_kw, max_weight_staleness=0, stale_policy="return")  # buffer crash
    assert ids(c.take_returned(2, request_id="rollout-8")) == [2, 3]  # a retry across it: same answer
    c.rewind(7, weight_version=1, forget_put_ids=[])  # driver crash, --load of step 7 (covers rollout 7)
    assert c.as_metrics()["returned_groups"] == 2 and c.as_metrics()["taken_uncovered_groups"] == 0
    c, _ = open_core(tmp_path, store_kw, max_weight_staleness=0, stale_policy="return")  # and a buffer crash
    assert ids(c.take_returned(5, request_id="rollout-8")) == [2, 3]  # regenerated rollout 8: taken again
    c.commit(8, covered_put_ids=["rollout-8"])
    c, _ = open_core(tmp_path, store_kw, max_weight_staleness=0, stale_policy="return")
    assert c.as_metrics()["taken_uncovered_groups"] == 0 and c.take_returned(5, request_id="rollout-9") == []
    c.rewind(8, weight_version=1)  # nothing uncovered left to give back
    assert c.take_returned(5, request_id="rollout-9") == []


def test_a_rewind_gives_back_the_takes_of_forgotten_or_missing_puts_and_keeps_the_covered_ones(tmp_path):
    """Which taken groups a rewind gives back, whatever commits were made: a take whose put is
    stored and not forgotten was regenerated into a put the checkpoint covers (a driver crash
    between the save and its commit: no commit named it), so it is final; a take whose put is
    forgotten, or never came, goes back."""
    c, _ = open_core(tmp_path, max_weight_staleness=0, stale_policy="return")
    c.put([make_group(i) for i in range(6)], put_id="rollout-0")
    c.set_version(1)
    for r, gids in ((1, [0, 1]), (2, [2, 3]), (3, [4, 5])):
        assert ids(c.take_returned(2, request_id=f"rollout-{r}")) == gids
    c.put([make_group(10, version=1)], put_id="rollout-1")  # rollout 1: covered by the checkpoint
    c.put([make_group(11, version=1)], put_id="rollout-2")  # rollout 2: put, then forgotten
    # rollout 3: the driver died before its put
    c.rewind(1, weight_version=1, forget_put_ids=["rollout-2"])
    c, _ = open_core(tmp_path, max_weight_staleness=0, stale_policy="return")
    assert c.as_metrics()["taken_uncovered_groups"] == 0
    assert ids(c.take_returned(10, request_id="rollout-2")) == [2, 3, 4, 5]
