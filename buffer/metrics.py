"""Counters the buffer keeps (since the actor's process started; the queue itself is durable)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

_FIELD = re.compile(r"field '(\w+)'")


def rejected_field(err: ValueError) -> str:
    """The Sample field a validation error names (``check_group``'s messages), for the metrics."""
    m = _FIELD.search(str(err))
    if m:
        return m.group(1)
    if "n_samples_per_prompt" in str(err):
        return "group_size"
    return "type"


@dataclass
class BufferMetrics:
    """Running counts. ``as_dict`` flattens them for ``metrics()`` (numbers, or dicts of numbers)."""

    puts: int = 0  # accepted put calls
    put_groups: int = 0
    duplicate_puts: int = 0  # retried puts recognised by put_id (not stored again)
    rejected_puts: int = 0
    rejected_groups: int = 0  # groups in rejected puts (a rejected put stores nothing)
    rejected_by_field: Counter = field(default_factory=Counter)
    gets: int = 0
    got_groups: int = 0
    drops: Counter = field(default_factory=Counter)  # reason -> groups
    returned_stale: int = 0  # stale groups set aside for take_returned
    taken_returned: int = 0
    staleness: Counter = field(default_factory=Counter)  # current - oldest version -> groups handed out
    commits: int = 0
    rewinds: int = 0
    rewound_groups: int = 0
    repeated_gets: int = 0  # get(step=k) retries answered with step k's batch (not a second batch)
    put_wait_s: float = 0.0  # time puts spent waiting for room (back-pressure)
    get_wait_s: float = 0.0  # time gets spent waiting for eligible groups
    waiting_puts: int = 0  # put calls waiting for room now (a gauge: tests and dashboards see back-pressure)
    waiting_gets: int = 0  # get calls waiting for eligible groups now (a gauge)
    recovered_groups: int = 0  # live groups found on disk at start-up

    def reject(self, err: ValueError, num_groups: int, field: str | None = None) -> None:
        self.rejected_puts += 1
        self.rejected_groups += num_groups
        self.rejected_by_field[field or rejected_field(err)] += 1

    def as_dict(self) -> dict[str, float | int | dict]:
        n = sum(self.staleness.values())
        mean = sum(k * v for k, v in self.staleness.items()) / n if n else 0.0
        return {
            "puts": self.puts, "put_groups": self.put_groups, "duplicate_puts": self.duplicate_puts,
            "rejected_puts": self.rejected_puts, "rejected_groups": self.rejected_groups,
            "rejected_by_field": dict(self.rejected_by_field),
            "gets": self.gets, "got_groups": self.got_groups,
            "drops": dict(self.drops), "dropped_groups": sum(self.drops.values()),
            "returned_stale": self.returned_stale, "taken_returned": self.taken_returned,
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "staleness_mean": mean, "staleness_max": max(self.staleness, default=0),
            "commits": self.commits, "rewinds": self.rewinds, "rewound_groups": self.rewound_groups,
            "repeated_gets": self.repeated_gets,
            "put_wait_s": self.put_wait_s, "get_wait_s": self.get_wait_s,
            "waiting_puts": self.waiting_puts, "waiting_gets": self.waiting_gets,
            "recovered_groups": self.recovered_groups,
        }
