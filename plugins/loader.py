"""The one extension mechanism: load a function by Python import path.

``load_function("my_pkg.rewards.rm", flag="--custom-rm-path")`` imports ``my_pkg.rewards`` and
returns its attribute ``rm``. Errors name the flag and the path, and are raised at start-up
(the launcher loads every plugin before any process starts).

Plugins written for slime import ``slime.*``: unless slime is installed, ``slime_compat`` answers
those imports (the alias of ``plugins/slime_alias.py``, installed here before the first plugin is
imported).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import inspect
import threading
from typing import Any, Callable, Iterator

from plugins import slime_alias


def load_function(path: str, flag: str, params: list[str] | None = None,
                  is_async: bool | None = None) -> Callable:
    """Import ``module.attr`` and check it is callable with the expected positional ``params``.

    ``params``: the names a caller passes positionally, in order (slime's plugin signatures);
    the function must accept that many positional arguments. ``is_async`` checks that the function
    is (True) or is not (False) a coroutine function; None accepts both.
    """
    if not isinstance(path, str) or "." not in path:
        raise ValueError(f"{flag} {path!r}: expected an import path like 'package.module.function'")
    module_name, _, attr = path.rpartition(".")
    slime_alias.install()  # plugins written for slime import slime.* (see the module doc)
    try:
        with _noting_atexit():
            module = importlib.import_module(module_name)
    except Exception as e:  # any import-time error is the user's plugin failing to load
        raise ValueError(f"{flag} {path!r}: cannot import module {module_name!r}: "
                         f"{type(e).__name__}: {e}") from e
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{flag} {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(fn):
        raise ValueError(f"{flag} {path!r}: {attr!r} is not callable")
    if params is not None:
        _check_signature(fn, path, flag, params)
    if is_async is not None and inspect.iscoroutinefunction(fn) != is_async:
        want = "an async function (async def)" if is_async else "a plain function (not async def)"
        raise ValueError(f"{flag} {path!r}: must be {want}")
    return fn


_atexit_lock = threading.RLock()  # a plugin module may load another while it is imported
_atexit_fns: list[Callable[[], Any]] = []


@contextlib.contextmanager
def _noting_atexit() -> Iterator[None]:
    """While a plugin module is imported, note the functions it registers with ``atexit`` (they
    are still registered): its cleanup, e.g. slime's fully_async stopping its worker thread."""
    with _atexit_lock:
        register = atexit.register

        def noting(fn: Callable, *args: Any, **kwargs: Any) -> Callable:
            if not args and not kwargs:
                _atexit_fns.append(fn)
            return register(fn, *args, **kwargs)
        atexit.register = noting
        try:
            yield
        finally:
            atexit.register = register


def plugin_atexit_functions() -> list[Callable[[], Any]]:
    """The functions plugin modules registered with ``atexit`` while ``load_function`` imported
    them (no-argument ones), in order. The rollout manager runs them at shutdown as well: a Ray
    actor may exit without running ``atexit``, and a plugin's worker must stop before the engines it
    uses go away. Such a function must tolerate running twice."""
    with _atexit_lock:
        return list(dict.fromkeys(_atexit_fns))


def _check_signature(fn: Callable, path: str, flag: str, params: list[str]) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without signatures: trust the user
    try:
        sig.bind(*params)
    except TypeError as e:
        raise ValueError(f"{flag} {path!r}: signature {fn.__name__}{sig} cannot be called as "
                         f"{fn.__name__}({', '.join(params)}): {e}") from None
