"""The buffer's logic, without Ray: FIFO queue, staleness bound, filter plugin, leases, metrics.

Every change of state other than a put is a small *record* (a dict) applied by ``_apply``:
the live path writes it to the journal first (when persistence is on) and then applies it;
recovery loads the persisted groups in put order and applies the same records again, so the
state after a crash is the state that was acknowledged before it. Records name groups by their
``gid`` (a counter assigned at put), never by position, so replay does not depend on where a
group sat in the queue.

Group life cycle: ``queue`` (eligible for get) -> leased to a step (``get(step=k)``) -> final at
``commit(k)``; or queue -> final at once (``get()`` without step, a stale drop); or queue ->
``returned`` (stale, policy "return") -> handed out by ``take_returned`` under a request id (the
put id of the rollout that regenerates them) -> final at the ``commit`` whose checkpoint covers
that put. ``rewind(s)`` moves groups leased to steps > s back to the front of the queue, and
groups handed out but not covered back to ``returned``: the rollout that took them is generated
again, and its data source (restored from the checkpoint) no longer has them. Final groups are
forgotten (the journal may delete their bytes).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from buffer.settings import BufferSettings
from buffer.metrics import BufferMetrics
from buffer.sample import Sample, check_group, group_oldest_version

PUT_ID_MEMORY = 10_000  # put_ids remembered for idempotent retries (the most recent ones)
_TAKES_KEPT = 16  # take_returned request ids remembered for retries (the most recent ones)


@dataclass(eq=False)
class Entry:
    """One stored group. ``segment``/``nbytes`` are the journal's bookkeeping."""

    gid: int
    group: list[Sample]
    oldest_version: int
    put_id: str | None = None
    segment: int = -1
    nbytes: int = 0


class Journal(Protocol):
    """Where persistence plugs in (``buffer.store.SegmentStore``); every write is durable on return."""

    def append(self, entries: list[Entry], put_id: str | None) -> None: ...
    def log(self, record: dict[str, Any]) -> None: ...
    def finalized(self, entries: list[Entry]) -> None: ...
    def open(self, core: "BufferCore") -> None: ...
    def maybe_compact(self, core: "BufferCore") -> None: ...
    def rewrite(self, core: "BufferCore") -> None: ...
    def bytes_on_disk(self) -> int: ...


class BufferCore:
    """The buffer's state machine. Not thread-safe: the actor calls it from its event loop only.

    ``filter_fn`` is the ``--buffer-filter-path`` plugin, called as slime does:
    ``filter_fn(plugin_args, rollout_id, buffer, num_samples)`` with ``buffer`` the list of
    eligible groups in FIFO order; it returns the groups it picks (removing them from ``buffer``).
    """

    def __init__(self, settings: BufferSettings, filter_fn: Callable | None = None,
                 plugin_args: Any = None, journal: Journal | None = None) -> None:
        self.settings = settings
        self._filter = filter_fn
        self._plugin_args = plugin_args
        self._journal = journal
        self._queue: OrderedDict[int, Entry] = OrderedDict()
        self._leases: dict[int, list[Entry]] = {}
        self._returned: OrderedDict[int, Entry] = OrderedDict()
        self._version = 0
        self._next_gid = 0
        self._put_ids: OrderedDict[str, int] = OrderedDict()
        # request id -> the groups a take_returned call with that id handed out (a retried call gets them again)
        self._takes: OrderedDict[str, list[list[Sample]]] = OrderedDict()
        # request id -> groups handed out by take_returned that no committed checkpoint covers yet
        self._taken: dict[str, list[Entry]] = {}
        self._calls = 0  # get calls that handed out groups: the filter's rollout_id without a step
        self.metrics = BufferMetrics()

    # --- put ---------------------------------------------------------------------------------
    def duplicate(self, put_id: str | None) -> int | None:
        """The number of groups an earlier put with this ``put_id`` stored, or None if new."""
        if put_id is None or put_id not in self._put_ids:
            return None
        self.metrics.duplicate_puts += 1
        return self._put_ids[put_id]

    def validate_put(self, groups: Any, put_id: str | None = None) -> None:
        """Reject a bad put (``ValueError`` naming the group and field), counting it in the metrics."""
        try:
            if not isinstance(groups, list) or not groups:
                raise ValueError(f"put(put_id={put_id!r}): expected a non-empty list of groups, "
                                 f"got {type(groups).__name__}")
            for i, group in enumerate(groups):
                first = group[0] if isinstance(group, list) and group else None
                where = f"put(put_id={put_id!r}) group {i} (group_index={getattr(first, 'group_index', None)})"
                check_group(group, self.settings.n_samples_per_prompt, where)
        except ValueError as e:
            self.metrics.reject(e, len(groups) if isinstance(groups, list) else 1)
            raise
        if len(groups) > self.settings.capacity:
            raise ValueError(f"put of {len(groups)} groups can never fit: --buffer-capacity is "
                             f"{self.settings.capacity} groups")

    def has_room(self, num_groups: int) -> bool:
        return len(self._queue) + num_groups <= self.settings.capacity

    def put(self, groups: list[list[Sample]], put_id: str | None = None) -> int:
        """Store validated groups (the caller checked ``validate_put`` and ``has_room``)."""
        entries = []
        for group in groups:
            entries.append(Entry(self._next_gid, group, group_oldest_version(group), put_id))
            self._next_gid += 1
        if self._journal is not None:
            try:
                self._journal.append(entries, put_id)  # durable before the put is acknowledged
            except ValueError as e:  # not storable: rejected like any bad input, nothing stored
                self.metrics.reject(e, len(groups), field="not_storable")
                raise
        for e in entries:
            self._queue[e.gid] = e
        if put_id is not None:
            self._remember_put(put_id, len(entries))
        self.metrics.puts += 1
        self.metrics.put_groups += len(entries)
        self._prune_stale(entries)
        return len(entries)

    def _remember_put(self, put_id: str, count: int) -> None:
        self._put_ids[put_id] = self._put_ids.get(put_id, 0) + count
        self._put_ids.move_to_end(put_id)
        while len(self._put_ids) > PUT_ID_MEMORY:
            self._put_ids.popitem(last=False)

    # --- get ---------------------------------------------------------------------------------
    def check_get(self, num_groups: int) -> None:
        if not isinstance(num_groups, int) or num_groups < 1:
            raise ValueError(f"get: num_groups must be a positive int, got {num_groups!r}")
        if num_groups > self.settings.capacity:
            raise ValueError(f"get of {num_groups} groups can never be served: --buffer-capacity is "
                             f"{self.settings.capacity} groups")

    def try_get(self, num_groups: int, step: int | None = None) -> list[list[Sample]] | None:
        """Take ``num_groups`` eligible groups now, or return None (nothing changes) if there are
        not enough (or the filter picked fewer). With ``step`` the groups are leased to that step
        until ``commit``; without, they are consumed for good."""
        self.check_get(num_groups)
        if step is not None and step in self._leases:
            return self._repeat_get(num_groups, step)
        if len(self._queue) < num_groups:
            return None
        if self._filter is None:
            picked = list(itertools.islice(self._queue.values(), num_groups))
        else:
            picked = self._run_filter(step if step is not None else self._calls, num_groups)
            if picked is None:
                return None
        self._calls += 1
        self._record({"op": "take", "gids": [e.gid for e in picked], "step": step})
        self.metrics.gets += 1
        self.metrics.got_groups += len(picked)
        for e in picked:
            self.metrics.staleness[max(0, self._version - e.oldest_version)] += 1
        if step is None:
            self._compact()
        return [e.group for e in picked]

    def _repeat_get(self, num_groups: int, step: int) -> list[list[Sample]]:
        """A second ``get(step=k)`` before ``rewind``: a retry whose first reply was lost (the
        buffer restarted, the caller's connection dropped). It gets the same batch, not a second."""
        leased = self._leases[step]
        if len(leased) != num_groups:
            raise ValueError(f"get(step={step}) of {num_groups} groups: step {step} already took "
                             f"{len(leased)} groups (a retry must ask for the same number)")
        self.metrics.repeated_gets += 1
        return [e.group for e in leased]

    def _run_filter(self, rollout_id: int, num_groups: int) -> list[Entry] | None:
        candidates = list(self._queue.values())
        by_id = {id(e.group): e for e in candidates}
        result = self._filter(self._plugin_args, rollout_id, [e.group for e in candidates], num_groups)
        where = f"--buffer-filter-path {self.settings.filter_path!r}"
        if not isinstance(result, list):
            raise RuntimeError(f"{where} returned {type(result).__name__}, expected a list of groups")
        picked: list[Entry] = []
        for g in result:
            e = by_id.pop(id(g), None)  # pop: a group returned twice is an error too
            if e is None:
                raise RuntimeError(f"{where} returned a group that is not (or no longer) in the buffer; "
                                   "it must return groups from the `buffer` list it was given")
            picked.append(e)
        if len(picked) > num_groups:
            raise RuntimeError(f"{where} returned {len(picked)} groups, {num_groups} were asked for")
        return picked if len(picked) == num_groups else None

    def take_returned(self, max_groups: int, request_id: str | None = None) -> list[list[Sample]]:
        """Hand out up to ``max_groups`` stale groups set aside by policy "return".

        ``request_id``: the put id of the rollout that regenerates them. The groups stay the
        buffer's until a ``commit`` names that put as covered by its checkpoint (a ``rewind``
        before that returns them); without an id they are final at once. A call retried with the
        same id (its answer lost in a restart of the buffer) gets the same groups again, also
        after a crash replayed the journal."""
        if not isinstance(max_groups, int) or max_groups < 0:
            raise ValueError(f"take_returned: max_groups must be an int >= 0, got {max_groups!r}")
        if request_id is not None and request_id in self._takes:
            return self._takes[request_id]
        picked = list(itertools.islice(self._returned.values(), max_groups))
        if picked:
            self._record({"op": "take_returned", "gids": [e.gid for e in picked], "request": request_id})
            self.metrics.taken_returned += len(picked)
            self._compact()
        return [e.group for e in picked]

    def returns_groups(self) -> bool:
        """Whether ``take_returned`` may hand out a group, now or later: stale groups are returned
        (policy "return" under a bound), or returned or taken groups are held (a rewind gives taken
        ones back), or a retried take would get its groups again. False stays False for good."""
        s = self.settings
        return ((s.stale_policy == "return" and s.max_weight_staleness is not None) or bool(self._returned)
                or bool(self._taken) or any(self._takes.values()))

    # --- versions, commit, rewind ---------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """The policy's current weight version; groups that fall out of the bound are pruned."""
        _check_version(version, "set_weight_version")
        if version != self._version:
            self._record({"op": "version", "v": version})
            self._prune_stale()

    def commit(self, step: int, covered_put_ids: list[str] | None = None, cover_known: bool = False) -> None:
        """Consumption by steps <= ``step`` is final (their trainer checkpoint is durable), and so
        are the groups ``take_returned`` handed out to the puts ``covered_put_ids`` (the rollouts
        that checkpoint covers). ``cover_known``: they are every put id known now
        (``known_put_ids``), as for a run without checkpoints, whose consumption is final as each
        step ends (one call instead of reading the ids first)."""
        self._check_step(step, "commit")
        if cover_known:
            covered_put_ids = self.known_put_ids()
        covered = sorted(set(covered_put_ids or ()) & set(self._taken))
        if any(s <= step for s in self._leases) or covered:
            self._record({"op": "commit", "step": step, "covered": covered})
            self._compact()
        self.metrics.commits += 1

    def rewind(self, step: int, weight_version: int | None = None,
               forget_put_ids: list[str] | None = None) -> int:
        """Resume from the checkpoint of ``step``: leases of steps <= step become final, groups
        leased to later steps return to the front of the queue in put order. Returns how many.

        ``weight_version``: the checkpoint's weight version, which the buffer's version goes back
        to *before* the staleness bound is applied (the buffer may have recorded later versions
        that the checkpoint lost; rewound groups are judged against the checkpoint's policy).
        ``forget_put_ids``: puts the checkpoint does not cover (their data is generated again):
        their groups are dropped wherever they wait (``drops["rewound"]``) and the ids forgotten,
        so the regenerated puts under the same ids are stored. Returned groups that
        ``take_returned`` handed out to one of those puts, or to a put that never came, go back
        to the returned groups; those of a stored put the checkpoint covers become final.
        Idempotent.
        """
        self._check_step(step, "rewind")
        if weight_version is not None:
            _check_version(weight_version, "rewind: weight_version")
        rewound = {e.gid for s, es in self._leases.items() if s > step for e in es}
        changed = False
        if weight_version is not None and weight_version != self._version:
            self._record({"op": "version", "v": weight_version})
            changed = True
        if self._leases or self._taken:
            # a take whose put the checkpoint covers (stored, not forgotten) is final; the others go
            # back: their rollout is generated again (or its put never happened)
            untake = [r for r in self._taken if r in set(forget_put_ids or ()) or r not in self._put_ids]
            self._record({"op": "rewind", "step": step, "untake": untake,
                          "covered": [r for r in self._taken if r not in untake]})
            changed = True
        forget = sorted(set(forget_put_ids or ()) & set(self._put_ids))
        gone: list[int] = []
        if forget:
            gone = [e.gid for e in [*self._queue.values(), *self._returned.values()] if e.put_id in forget]
            self._record({"op": "forget", "put_ids": forget, "gids": gone, "before_gid": self._next_gid})
            self.metrics.drops["rewound"] += len(gone)
            changed = True
        if changed:
            self._prune_stale()
            self._compact()
        back = len(rewound - set(gone))
        self.metrics.rewinds += 1
        self.metrics.rewound_groups += back
        return back

    def known_put_ids(self) -> list[str]:
        """The put ids a retry would be recognised by (the most recent ``PUT_ID_MEMORY``), oldest first."""
        return list(self._put_ids)

    @staticmethod
    def _check_step(step: int, what: str) -> None:
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"{what}: step must be an int, got {step!r}")

    # --- staleness -----------------------------------------------------------------------------
    def _prune_stale(self, entries: list[Entry] | None = None) -> None:
        bound = self.settings.max_weight_staleness
        if bound is None:
            return
        candidates = self._queue.values() if entries is None else entries
        stale = [e.gid for e in candidates if self._version - e.oldest_version > bound and e.gid in self._queue]
        if not stale:
            return
        if self.settings.stale_policy == "drop":
            self._record({"op": "drop", "gids": stale, "reason": "stale"})
            self.metrics.drops["stale"] += len(stale)
            self._compact()
        else:
            self._record({"op": "return", "gids": stale})
            self.metrics.returned_stale += len(stale)

    # --- records --------------------------------------------------------------------------
    def _record(self, record: dict[str, Any]) -> None:
        if self._journal is not None:
            self._journal.log(record)  # durable first: a crash replays it or never saw it
        self._apply(record)

    def _apply(self, rec: dict[str, Any]) -> None:
        op = rec["op"]
        if op == "take":
            taken = self._pop(self._queue, rec["gids"])
            if rec["step"] is None:
                self._finalize(taken)
            else:
                self._leases.setdefault(rec["step"], []).extend(taken)
        elif op == "drop":
            self._finalize(self._pop(self._queue, rec["gids"]))
        elif op == "return":
            for e in self._pop(self._queue, rec["gids"]):
                self._returned[e.gid] = e
        elif op == "take_returned":
            taken = self._pop(self._returned, rec["gids"])
            if rec.get("request") is None:
                self._finalize(taken)
            else:
                self._taken.setdefault(rec["request"], []).extend(taken)
                self._remember_take(rec["request"], [e.group for e in taken])
        elif op == "commit":
            self._commit_leases(rec["step"])
            for request in rec.get("covered", ()):
                self._finalize(self._taken.pop(request, []))
        elif op == "rewind":
            self._commit_leases(rec["step"])
            for request in rec.get("covered", ()):
                self._finalize(self._taken.pop(request, []))
            untaken = sorted((e for r in rec.get("untake", ()) for e in self._taken.pop(r, [])), key=lambda e: e.gid)
            for request in rec.get("untake", ()):
                self._takes.pop(request, None)  # the regenerated rollout takes afresh
            for e in reversed(untaken):  # first in line for the next take, in put order
                self._returned[e.gid] = e
                self._returned.move_to_end(e.gid, last=False)
            back = sorted((e for s in [s for s in self._leases if s > rec["step"]] for e in self._leases.pop(s)),
                          key=lambda e: e.gid)
            for e in reversed(back):  # each to the front: they end up first, in put order
                self._queue[e.gid] = e
                self._queue.move_to_end(e.gid, last=False)
        elif op == "forget":
            self._finalize([*self._pop(self._queue, rec["gids"]), *self._pop(self._returned, rec["gids"])])
            for put_id in rec["put_ids"]:
                # At replay, groups put again after the forget (gid >= before_gid) keep their id known.
                again = sum(1 for e in self.live_entries() if e.put_id == put_id and e.gid >= rec["before_gid"])
                if again:
                    self._put_ids[put_id] = again
                else:
                    self._put_ids.pop(put_id, None)
        elif op == "version":
            self._version = rec["v"]
        elif op == "state":
            self._load_state(rec)
        else:
            raise RuntimeError(f"unknown buffer journal record {op!r}")

    @staticmethod
    def _pop(where: OrderedDict[int, Entry], gids: list[int]) -> list[Entry]:
        # Unknown gids are tolerated: at replay they are groups whose segment was deleted (final).
        return [where.pop(g) for g in gids if g in where]

    def _remember_take(self, request: str, groups: list[list[Sample]]) -> None:
        self._takes[request] = groups
        while len(self._takes) > _TAKES_KEPT:
            self._takes.popitem(last=False)

    def _commit_leases(self, step: int) -> None:
        for s in [s for s in self._leases if s <= step]:
            self._finalize(self._leases.pop(s))

    def _finalize(self, entries: list[Entry]) -> None:
        if entries and self._journal is not None:
            self._journal.finalized(entries)

    def _compact(self) -> None:
        if self._journal is not None:
            self._journal.maybe_compact(self)

    # --- whole-state views (journal compaction, save/restore, recovery) -----------------------
    def live_entries(self) -> list[Entry]:
        """Every group not yet final: queue order, then leases by step, then returned, then taken."""
        leased = [e for s in sorted(self._leases) for e in self._leases[s]]
        taken = [e for es in self._taken.values() for e in es]
        return [*self._queue.values(), *leased, *self._returned.values(), *taken]

    def state_record(self) -> dict[str, Any]:
        """A record that rebuilds the current state from the live groups' bytes (gid < next_gid)."""
        return {"op": "state", "version": self._version, "next_gid": self._next_gid,
                "queue": list(self._queue), "returned": list(self._returned),
                "leases": {str(s): [e.gid for e in es] for s, es in self._leases.items()},
                "taken": {r: [e.gid for e in es] for r, es in self._taken.items()},
                "put_ids": dict(self._put_ids)}

    def _load_state(self, rec: dict[str, Any]) -> None:
        known = dict(self._queue)
        # Groups put after this state record was written (gid >= its next_gid) stay queued after it.
        later = [known.pop(g) for g in list(known) if g >= rec["next_gid"]]
        self._queue = OrderedDict((g, known.pop(g)) for g in rec["queue"] if g in known)
        self._returned = OrderedDict((g, known.pop(g)) for g in rec["returned"] if g in known)
        self._leases = {}
        for s, gids in rec["leases"].items():
            self._leases[int(s)] = [known.pop(g) for g in gids if g in known]
        self._taken = {}
        for request, gids in rec.get("taken", {}).items():  # state records before takes were kept: none
            self._taken[request] = [known.pop(g) for g in gids if g in known]
            self._remember_take(request, [e.group for e in self._taken[request]])
        for e in later:
            self._queue[e.gid] = e
        self._finalize(list(known.values()))  # everything else was final when the state was written
        self._version = rec["version"]
        self._next_gid = max(self._next_gid, rec["next_gid"])
        for put_id, n in rec["put_ids"].items():
            self._put_ids[put_id] = n

    def recover(self, entries: list[Entry], records: list[dict[str, Any]]) -> None:
        """Rebuild the state from persisted groups (any order) and journal records, then reopen
        the journal for appending and apply the staleness bound of the current settings."""
        journal, self._journal = self._journal, None  # replay: nothing is written again
        try:
            for e in sorted(entries, key=lambda e: e.gid):
                self._queue[e.gid] = e
                self._next_gid = max(self._next_gid, e.gid + 1)
                if e.put_id is not None:
                    self._remember_put(e.put_id, 1)
            for rec in records:
                self._apply(rec)
        finally:
            self._journal = journal
        if journal is not None:
            journal.open(self)
        self.metrics.recovered_groups = len(self.live_entries())
        self._prune_stale()

    def replace_with(self, entries: list[Entry], records: list[dict[str, Any]]) -> None:
        """Restore: the state becomes the one the entries and records describe (persisted first)."""
        fresh = BufferCore(self.settings)
        fresh.recover(entries, records)
        if self._journal is not None:
            self._journal.rewrite(fresh)
        self._queue, self._leases, self._returned = fresh._queue, fresh._leases, fresh._returned
        self._taken, self._takes = fresh._taken, fresh._takes
        self._version, self._next_gid, self._put_ids = fresh._version, fresh._next_gid, fresh._put_ids
        self._prune_stale()

    # --- views ------------------------------------------------------------------------------
    def size(self) -> int:
        """Groups waiting in the queue (eligible for get)."""
        return len(self._queue)

    def as_metrics(self) -> dict[str, float | int | dict]:
        m = self.metrics.as_dict()
        m.update(size=len(self._queue), capacity=self.settings.capacity,
                 leased_groups=sum(len(es) for es in self._leases.values()), leased_steps=len(self._leases),
                 returned_groups=len(self._returned), weight_version=self._version,
                 taken_uncovered_groups=sum(len(es) for es in self._taken.values()),
                 bytes_on_disk=self._journal.bytes_on_disk() if self._journal is not None else 0)
        return m


def _check_version(version: int, what: str) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"{what}: expected an int >= 0, got {version!r}")
