"""The buffer's settings (flags in ``buffer/arguments.py``) and the filter plugin they name.

Its own module, importing nothing of ours but the plugin loader, so the actor, its core and its store
read the settings without importing ``buffer.interfaces`` (which starts the actor).
"""

from __future__ import annotations

from dataclasses import dataclass

STALE_POLICIES = ("drop", "return")
FILTER_PARAMS = ["args", "rollout_id", "buffer", "num_samples"]


@dataclass
class BufferSettings:
    """Settings of the data buffer (flags in ``buffer/arguments.py``)."""

    n_samples_per_prompt: int | None = None  # None: group size not checked
    capacity: int = 1024  # in groups; put waits while full
    put_timeout_s: float = 600.0  # then a TimeoutError naming the capacity and --buffer-capacity
    max_weight_staleness: int | None = None  # K; None = unbounded; 0 = strictly on-policy
    stale_policy: str = "drop"  # "drop" | "return" (returned groups await take_returned)
    persist_dir: str | None = None  # --buffer-dir
    filter_path: str | None = None  # --buffer-filter-path
    fsync: bool = False  # fsync each put (survive machine crash, not only process crash)
    get_timeout_s: float = 1800.0  # get(timeout_s=None) waits this long, then TimeoutError
    segment_bytes: int = 64 << 20  # a segment file is closed (and later deletable) past this size

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag of the first bad setting."""
        if self.n_samples_per_prompt is not None and self.n_samples_per_prompt < 1:
            raise ValueError(f"--n-samples-per-prompt must be >= 1, got {self.n_samples_per_prompt}")
        if self.capacity < 1:
            raise ValueError(f"--buffer-capacity must be >= 1, got {self.capacity}")
        if not self.put_timeout_s > 0:
            raise ValueError(f"--buffer-put-timeout must be > 0, got {self.put_timeout_s}")
        if not self.get_timeout_s > 0:
            raise ValueError(f"--buffer-get-timeout must be > 0, got {self.get_timeout_s}")
        if self.max_weight_staleness is not None and self.max_weight_staleness < 0:
            raise ValueError(f"--max-weight-staleness must be >= 0 (or unset), got {self.max_weight_staleness}")
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(f"--stale-policy must be one of {STALE_POLICIES}, got {self.stale_policy!r}")
        if self.fsync and self.persist_dir is None:
            raise ValueError("--buffer-fsync needs --buffer-dir (there is nothing to fsync in memory)")
        if self.segment_bytes < 1:
            raise ValueError(f"segment_bytes must be >= 1, got {self.segment_bytes}")


def load_filter(settings: BufferSettings):
    """The ``--buffer-filter-path`` function, checked against slime's signature; None if unset."""
    if settings.filter_path is None:
        return None
    from plugins.loader import load_function

    return load_function(settings.filter_path, "--buffer-filter-path", FILTER_PARAMS, is_async=False)
