"""The buffer's settings (each field declares its flag) and the filter plugin they name.

Its own module, importing nothing of ours but the plugin loader and :mod:`flags`, so the actor,
its core and its store read the settings without importing ``buffer.interfaces`` (which starts
the actor).
"""

from __future__ import annotations

from dataclasses import dataclass

from flags import SettingError, flag

STALE_POLICIES = ("drop", "return")
FILTER_PARAMS = ["args", "rollout_id", "buffer", "num_samples"]


@dataclass
class BufferSettings:
    """Settings of the data buffer; each field declares its flag (``buffer/arguments.py``)."""

    n_samples_per_prompt: int | None = flag(None, declared_elsewhere=True)  # the rollout's; None: not checked
    capacity: int = flag(1024, "groups the buffer holds; put waits while it is full (back-pressure)",
                         name="--buffer-capacity", group="buffer")
    put_timeout_s: float = flag(600.0, "seconds a put waits for room before failing", name="--buffer-put-timeout")
    max_weight_staleness: int | None = flag(
        None, "K: withhold groups whose oldest weight version is more than K behind the current one (0 = strictly "
        "on-policy; unset = unbounded)")
    stale_policy: str = flag("drop", "what happens to a group that broke the staleness bound: dropped, or returned "
                             "to the rollout side for regeneration (take_returned)", choices=STALE_POLICIES)
    persist_dir: str | None = flag(None, "persist the buffer here (Arrow files): acknowledged groups survive crashes",
                                   name="--buffer-dir")
    filter_path: str | None = flag(None, "pop(args, rollout_id, buffer, num_samples) -> groups: picks the groups a "
                                   "get returns", name="--buffer-filter-path")
    fsync: bool = flag(False, "fsync every put and log record (survive a machine crash, not only a process crash)",
                       name="--buffer-fsync")
    get_timeout_s: float = flag(1800.0, "seconds a get waits for enough eligible groups before failing",
                                name="--buffer-get-timeout")
    segment_bytes: int = 64 << 20  # a segment file is closed (and later deletable) past this size

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`flags.SettingError` naming the first bad field(s) (the flags, when built by
        ``flags.from_args``)."""
        if self.n_samples_per_prompt is not None and self.n_samples_per_prompt < 1:
            raise SettingError("n_samples_per_prompt",
                               f"{{n_samples_per_prompt}} must be >= 1, got {self.n_samples_per_prompt}")
        if self.capacity < 1:
            raise SettingError("capacity", f"{{capacity}} must be >= 1, got {self.capacity}")
        if not self.put_timeout_s > 0:
            raise SettingError("put_timeout_s", f"{{put_timeout_s}} must be > 0, got {self.put_timeout_s}")
        if not self.get_timeout_s > 0:
            raise SettingError("get_timeout_s", f"{{get_timeout_s}} must be > 0, got {self.get_timeout_s}")
        if self.max_weight_staleness is not None and self.max_weight_staleness < 0:
            raise SettingError("max_weight_staleness",
                               f"{{max_weight_staleness}} must be >= 0 (or unset), got {self.max_weight_staleness}")
        if self.stale_policy not in STALE_POLICIES:
            raise SettingError("stale_policy", f"{{stale_policy}} must be one of {STALE_POLICIES}, got "
                                               f"{self.stale_policy!r}")
        if self.fsync and self.persist_dir is None:
            raise SettingError(("fsync", "persist_dir"),
                               "{fsync} needs {persist_dir} (there is nothing to fsync in memory)")
        if self.segment_bytes < 1:
            raise SettingError("segment_bytes", f"{{segment_bytes}} must be >= 1, got {self.segment_bytes}")


def load_filter(settings: BufferSettings):
    """The ``--buffer-filter-path`` function, checked against slime's signature; None if unset."""
    if settings.filter_path is None:
        return None
    from plugins.loader import load_function

    return load_function(settings.filter_path, "--buffer-filter-path", FILTER_PARAMS, is_async=False)
