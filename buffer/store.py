"""Persistence of the buffer: append-only Arrow segment files plus a small JSON-lines log.

Layout of ``--buffer-dir``::

    CURRENT                      # the live generation number (replaced atomically)
    gen-000003/seg-000000.arrows # Arrow IPC streams: one record batch per put (buffer.arrow's
    gen-000003/seg-000001.arrows #   columns + _gid, _put_id), readable by pyarrow.ipc.open_stream
    gen-000003/log.jsonl         # every state change but puts: take/drop/return/commit/rewind/...

A put is acknowledged only after its batch was written (and fsynced with ``fsync``); a log record
is written before the change it describes is applied. A crash mid-write leaves a torn tail:
at the end of a segment it is an unacknowledged put and is ignored (a restarted store never
appends to an old segment), at the end of the log it is truncated away.

Space: a closed segment whose groups are all final is deleted, right after the log was replaced
by one ``state`` record (which carries the recent put ids, so a retried put stays idempotent
after its bytes are gone); the log is also replaced so when it grows large; when live data is a small fraction of what is on disk, the
live groups are rewritten into a new generation and ``CURRENT`` switches to it (the same
path as ``restore``). Any write error stops the store (``RuntimeError`` afterwards): restart the
actor to recover from what is on disk.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from buffer.arrow import SCHEMA, groups_to_record_batch, record_batch_to_groups
from buffer.core import Entry
from buffer.settings import BufferSettings

if TYPE_CHECKING:
    from buffer.core import BufferCore

log = logging.getLogger(__name__)

SEGMENT_SCHEMA = SCHEMA.append(pa.field("_gid", pa.int64())).append(pa.field("_put_id", pa.string()))
LOG_NAME = "log.jsonl"
SNAPSHOT_BATCH_GROUPS = 64  # groups per record batch when a whole state is written at once
LOCK_WAIT_S = 30.0  # a killed predecessor's lock goes with its process; wait that long for it


def _seg_name(n: int) -> str:
    return f"seg-{n:06d}.arrows"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def segment_batch(entries: list[Entry], put_id: str | None) -> pa.RecordBatch:
    """One record batch for a put: the Sample columns plus each row's group id and put id."""
    batch = groups_to_record_batch([e.group for e in entries])
    sizes = np.fromiter((len(e.group) for e in entries), dtype=np.int64, count=len(entries))
    gids = np.repeat(np.fromiter((e.gid for e in entries), dtype=np.int64, count=len(entries)), sizes)
    pids = [e.put_id if put_id is None else put_id for e in entries for _ in e.group]
    return pa.RecordBatch.from_arrays([*batch.columns, pa.array(gids), pa.array(pids, type=pa.string())],
                                      schema=SEGMENT_SCHEMA)


def read_segment(path: Path, segment: int) -> list[Entry]:
    """The groups of one segment file; a torn tail (an unacknowledged put) is skipped."""
    entries: list[Entry] = []
    size = path.stat().st_size
    with pa.OSFile(str(path)) as src:
        try:
            reader = pa.ipc.open_stream(src)
            while True:
                start = src.tell()
                batch = reader.read_next_batch()
                nbytes = (src.tell() - start) // max(1, len(set(batch.column("_gid").to_pylist())))
                gids = batch.column("_gid").to_pylist()
                pids = batch.column("_put_id").to_pylist()
                starts = [0] + [i for i in range(1, len(gids)) if gids[i] != gids[i - 1]]
                for row, group in zip(starts, record_batch_to_groups(batch)):
                    entries.append(Entry(gids[row], group, min(v for s in group for v in s.weight_versions),
                                         pids[row], segment, nbytes))
        except StopIteration:
            pass
        except (OSError, pa.ArrowInvalid) as e:
            log.warning("buffer store: %s: ignoring a torn tail after byte %d of %d (%s): a put that "
                        "was never acknowledged", path, src.tell(), size, e)
    return entries


def read_log(path: Path, truncate_torn: bool) -> list[dict[str, Any]]:
    """The records of a log file; a torn last line is dropped (and cut off if ``truncate_torn``)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        log.warning("buffer store: %s: dropping a torn last record (%d bytes)", path, len(data) - end)
        if truncate_torn:
            os.truncate(path, end)
    records = []
    for i, line in enumerate(data[:end].splitlines()):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise RuntimeError(f"buffer store: {path} line {i + 1} is corrupt ({e}); only a torn last "
                               "line is expected after a crash") from e
    return records


def read_generation(directory: Path, truncate_torn: bool = False) -> tuple[list[Entry], list[dict[str, Any]]]:
    """All groups of a generation directory (or a ``save`` snapshot) and its log records."""
    entries: list[Entry] = []
    seen: set[int] = set()
    for path in sorted(directory.glob("seg-*.arrows")):
        for e in read_segment(path, int(path.name[4:10])):
            if e.gid not in seen:
                seen.add(e.gid)
                entries.append(e)
    return entries, read_log(directory / LOG_NAME, truncate_torn)


def write_generation(directory: Path, core: "BufferCore", fsync: bool) -> list[tuple[Entry, int, int]]:
    """Write the live groups and one ``state`` record into an empty directory.

    Returns ``(entry, segment, nbytes)`` for each live entry; the caller adopts them once the
    directory is switched to (the entries are not touched here, in case the switch fails)."""
    directory.mkdir(parents=True, exist_ok=False)
    live = core.live_entries()
    placed: list[tuple[Entry, int, int]] = []
    with open(directory / _seg_name(0), "xb", buffering=0) as f:
        with pa.ipc.new_stream(f, SEGMENT_SCHEMA) as writer:
            for i in range(0, len(live), SNAPSHOT_BATCH_GROUPS):
                chunk = live[i:i + SNAPSHOT_BATCH_GROUPS]
                start = f.tell()
                writer.write_batch(segment_batch(chunk, None))
                per = (f.tell() - start) // len(chunk)
                placed += [(e, 0, per) for e in chunk]
        if fsync:
            os.fsync(f.fileno())
    with open(directory / LOG_NAME, "xb", buffering=0) as f:
        f.write((json.dumps(core.state_record(), separators=(",", ":")) + "\n").encode())
        if fsync:
            os.fsync(f.fileno())
    if fsync:
        _fsync_dir(directory)
    return placed


class SegmentStore:
    """The journal of a persistent buffer (see the module docstring). Single-threaded."""

    def __init__(self, root: str | Path, fsync: bool = BufferSettings.fsync,
                 segment_bytes: int = BufferSettings.segment_bytes,
                 log_compact_bytes: int = 16 << 20, compact_min_bytes: int = 256 << 20,
                 compact_factor: float = 4.0, lock_wait_s: float = LOCK_WAIT_S) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.log_compact_bytes = log_compact_bytes
        self.compact_min_bytes = compact_min_bytes
        self.compact_factor = compact_factor
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--buffer-dir {str(root)!r}: cannot create it: {e}") from e
        self._lock_fd = self._lock(lock_wait_s)
        current = self.root / "CURRENT"
        self._gen = int(current.read_text().strip()) if current.exists() else 0
        self._seg_live: dict[int, int] = {}  # segment -> live groups
        self._seg_bytes: dict[int, int] = {}
        self._dead: set[int] = set()  # closed segments with no live group, deleted at the next compaction
        self._live_bytes = 0
        self._log_bytes = 0
        self._active = 0
        self._file = None
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._log_fd: int | None = None
        self._failed: BaseException | None = None

    @property
    def directory(self) -> Path:
        return self.root / f"gen-{self._gen:06d}"

    # --- start-up ----------------------------------------------------------------------------
    def load(self) -> tuple[list[Entry], list[dict[str, Any]]]:
        """Read the live generation (dropping leftovers of an interrupted switch)."""
        for p in self.root.iterdir():
            if p.name.startswith("gen-") and p != self.directory:
                shutil.rmtree(p)  # a generation that lost (or never won) the CURRENT switch
        self.directory.mkdir(exist_ok=True)
        return read_generation(self.directory, truncate_torn=True)

    def open(self, core: "BufferCore") -> None:
        """Start appending (after ``core`` replayed ``load``'s output); reclaim dead segments."""
        self._seg_live, self._live_bytes = {}, 0
        for e in core.live_entries():
            self._seg_live[e.segment] = self._seg_live.get(e.segment, 0) + 1
            self._live_bytes += e.nbytes
        segments = [int(p.name[4:10]) for p in self.directory.glob("seg-*.arrows")]
        self._seg_bytes = {n: (self.directory / _seg_name(n)).stat().st_size for n in segments}
        self._dead = {n for n in segments if not self._seg_live.get(n)}
        self._active = max(segments, default=-1) + 1  # never append after a possibly torn tail
        log_path = self.directory / LOG_NAME
        self._log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._log_bytes = os.fstat(self._log_fd).st_size
        self.maybe_compact(core)

    # --- the Journal protocol ----------------------------------------------------------------
    def append(self, entries: list[Entry], put_id: str | None) -> None:
        self._check()
        try:  # conversion first: a group Arrow cannot hold is bad input, not a broken store
            batch = segment_batch(entries, put_id)
        except (ValueError, TypeError, OverflowError, pa.ArrowException) as e:
            raise ValueError(f"put(put_id={put_id!r}): the groups cannot be stored as Arrow rows (a field "
                             f"holds a value that is not JSON/numeric as the Sample contract says): "
                             f"{type(e).__name__}: {e}") from e
        try:
            if self._writer is None:
                self._open_segment()
            start = self._file.tell()
            self._writer.write_batch(batch)
            if self.fsync:
                os.fsync(self._file.fileno())
            end = self._file.tell()
        except BaseException as e:
            self._fail(e)
            raise
        per = (end - start) // len(entries)
        for e in entries:
            e.segment, e.nbytes = self._active, per
        self._seg_live[self._active] = self._seg_live.get(self._active, 0) + len(entries)
        self._seg_bytes[self._active] = end
        self._live_bytes += per * len(entries)
        if end >= self.segment_bytes:
            self._close_segment()

    def log(self, record: dict[str, Any]) -> None:
        self._check()
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        try:
            written = os.write(self._log_fd, data)
            if written != len(data):
                raise OSError(f"short write to the buffer log ({written} of {len(data)} bytes)")
            if self.fsync:
                os.fsync(self._log_fd)
        except BaseException as e:
            self._fail(e)
            raise
        self._log_bytes += len(data)

    def finalized(self, entries: list[Entry]) -> None:
        for e in entries:
            self._live_bytes -= e.nbytes
            left = self._seg_live[e.segment] = self._seg_live.get(e.segment, 0) - 1
            if left <= 0 and e.segment != self._active:
                self._dead.add(e.segment)

    def bytes_on_disk(self) -> int:
        return sum(self._seg_bytes.values()) + self._log_bytes

    def maybe_compact(self, core: "BufferCore") -> None:
        on_disk = self.bytes_on_disk()
        if on_disk > self.compact_min_bytes and on_disk > self.compact_factor * max(self._live_bytes, 1):
            self.rewrite(core)
        elif self._dead or self._log_bytes > self.log_compact_bytes:
            self._compact_log(core)  # first: the state record keeps the dead segments' put ids
            for n in sorted(self._dead):
                self._delete_segment(n)
            self._dead.clear()

    def rewrite(self, core: "BufferCore") -> None:
        """Write ``core``'s live state into a new generation and switch ``CURRENT`` to it."""
        self._check()
        self._close_segment()
        old, new = self.directory, self.root / f"gen-{self._gen + 1:06d}"
        try:
            if new.exists():
                shutil.rmtree(new)
            placed = write_generation(new, core, self.fsync)
            tmp = self.root / "CURRENT.tmp"
            tmp.write_text(f"{self._gen + 1}\n")
            if self.fsync:
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, self.root / "CURRENT")  # the switch: atomic
            if self.fsync:
                _fsync_dir(self.root)
        except BaseException as e:
            self._fail(e)
            raise
        os.close(self._log_fd)
        self._gen += 1
        shutil.rmtree(old)
        for e, segment, nbytes in placed:
            e.segment, e.nbytes = segment, nbytes
        self.open(core)

    def close(self) -> None:
        self._close_segment()
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the directory
            self._lock_fd = None

    # --- internals ---------------------------------------------------------------------------
    def _lock(self, wait_s: float) -> int:
        """One process per directory: two buffers appending to one log would corrupt it.

        A POSIX record lock belongs to the process, so the kernel drops it when the process dies
        (SIGKILL included) and a restarted actor gets it."""
        fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except OSError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise RuntimeError(f"--buffer-dir {str(self.root)!r} is in use by another buffer "
                                       f"process (still locked after {wait_s:g}s)") from None
                time.sleep(0.1)

    def _check(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"buffer store at {self.root} stopped after a write error "
                               f"({type(self._failed).__name__}: {self._failed}); restart the buffer "
                               "actor to recover what was acknowledged") from self._failed
        if self._log_fd is None:
            raise RuntimeError("buffer store used before open() (call BufferCore.recover first)")

    def _fail(self, e: BaseException) -> None:
        self._failed = e
        log.error("buffer store at %s: write failed, the store stops: %r", self.root, e)

    def _open_segment(self) -> None:
        path = self.directory / _seg_name(self._active)
        self._file = open(path, "xb", buffering=0)  # unbuffered: each write reaches the OS at once
        self._writer = pa.ipc.new_stream(self._file, SEGMENT_SCHEMA)
        if self.fsync:
            _fsync_dir(self.directory)
        self._seg_bytes[self._active] = self._file.tell()

    def _close_segment(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._file.close()
        self._writer = self._file = None
        done = self._active
        self._seg_bytes[done] = (self.directory / _seg_name(done)).stat().st_size
        self._active += 1
        if not self._seg_live.get(done):
            self._dead.add(done)

    def _delete_segment(self, n: int) -> None:
        (self.directory / _seg_name(n)).unlink(missing_ok=True)
        self._seg_bytes.pop(n, None)
        self._seg_live.pop(n, None)

    def _compact_log(self, core: "BufferCore") -> None:
        path, tmp = self.directory / LOG_NAME, self.directory / (LOG_NAME + ".tmp")
        data = (json.dumps(core.state_record(), separators=(",", ":")) + "\n").encode()
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            if self.fsync:
                _fsync_dir(self.directory)
        except BaseException as e:
            self._fail(e)
            raise
        os.close(self._log_fd)
        self._log_fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._log_bytes = len(data)
