"""``slime.utils.misc``: ``load_function``, ``SingletonMeta``, ``group_by``."""

from __future__ import annotations

import functools
import importlib
from collections import defaultdict
from typing import Any, Callable, Iterable


@functools.cache
def load_function(path: str) -> Callable:
    """Import ``module.attr`` and return the attribute (slime's helper: cached, no checks).

    Reservoir's own plugin flags go through ``plugins.loader.load_function``, which checks the
    signature at start-up; this one is for plugins that load further plugins themselves."""
    import slime_compat

    slime_compat.install()
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


class SingletonMeta(type):
    """A metaclass whose classes have one instance (the first call's arguments build it)."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]

    def clear_instances(cls) -> None:
        cls._instances = {}


def group_by(iterable: Iterable, key: Callable | None = None) -> dict:
    """Like ``itertools.groupby`` without needing sorted input."""
    out: dict = defaultdict(list)
    for item in iterable:
        out[key(item) if key is not None else item].append(item)
    return dict(out)


def should_run_periodic_action(rollout_id: int, interval: int | None, num_rollout_per_epoch: int | None = None,
                               num_rollout: int | None = None) -> bool:
    """Whether a periodic action (eval, save) is due after rollout ``rollout_id`` (0-based)."""
    if interval is None:
        return False
    if num_rollout is not None and rollout_id == num_rollout - 1:
        return True
    step = rollout_id + 1
    return step % interval == 0 or (num_rollout_per_epoch is not None and step % num_rollout_per_epoch == 0)
