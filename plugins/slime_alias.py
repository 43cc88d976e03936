"""The ``slime`` import alias: ``slime`` and ``slime.<x>`` answered with ``slime_compat.<x>``.

A plugin written for slime imports ``slime.*``. When slime itself is not installed, ``install()``
puts an import hook first on ``sys.meta_path`` that hands out the module ``slime_compat.<x>`` as
``slime.<x>``: the very same module object (``slime.utils.types.Sample is buffer.sample.Sample``),
so ``isinstance`` checks in plugins hold. When slime is installed the hook is never installed: a
real slime is never shadowed. A ``slime.*`` module that ``slime_compat`` does not provide raises
``ModuleNotFoundError`` naming it.

It lives here, not in ``slime_compat``, because ``plugins.loader.load_function`` installs it before
it imports any plugin, and the loader sits below every package (``slime_compat`` sits above them
all). The hook names ``slime_compat`` only as a string and imports it when a plugin first imports
``slime``, as the loader imports any plugin module by its path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading

_COMPAT = "slime_compat"  # the package that answers slime's module paths
_lock = threading.Lock()
_installed: "_AliasFinder | None" = None


class _AliasLoader(importlib.abc.Loader):
    """Hands out the ``slime_compat.<x>`` module (imported under its own name) as ``slime.<x>``."""

    def __init__(self, real_name: str):
        self.real_name = real_name

    def create_module(self, spec):
        return importlib.import_module(self.real_name)

    def exec_module(self, module) -> None:
        pass  # executed once, under its own name


class _AliasFinder(importlib.abc.MetaPathFinder):
    """``slime`` and ``slime.*`` -> ``slime_compat`` and ``slime_compat.*``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "slime" and not fullname.startswith("slime."):
            return None
        real_name = _COMPAT + fullname[len("slime"):]
        try:
            real = importlib.util.find_spec(real_name)
        except ImportError:
            real = None
        if real is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: slime is not installed and Reservoir's slime compatibility "
                f"layer (slime_compat) does not provide this module (docs/slime.md lists the ones it does)",
                name=fullname)
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real_name),
                                               is_package=real.submodule_search_locations is not None)


def slime_installed() -> bool:
    """Whether a real slime is importable (the hook is then never installed)."""
    if _installed is not None:
        return False
    mod = sys.modules.get("slime")
    if mod is not None:
        return not getattr(mod, "__name__", "").startswith(_COMPAT)
    return importlib.util.find_spec("slime") is not None


def install() -> bool:
    """Expose ``slime_compat`` as ``slime`` unless slime is installed; returns whether the hook is
    active. Idempotent and thread-safe."""
    global _installed
    with _lock:
        if _installed is not None:
            return True
        if slime_installed():
            return False
        _installed = _AliasFinder()
        sys.meta_path.insert(0, _installed)
        return True


def uninstall() -> None:
    """Remove the hook and the ``slime`` aliases it created (tests)."""
    global _installed
    with _lock:
        if _installed is None:
            return
        sys.meta_path.remove(_installed)
        _installed = None
        for name in [n for n in sys.modules if n == "slime" or n.startswith("slime.")]:
            if getattr(sys.modules[name], "__name__", "").startswith(_COMPAT):
                del sys.modules[name]
