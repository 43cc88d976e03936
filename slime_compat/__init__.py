"""slime's plugin-facing modules, for plugins written for slime to run in Reservoir unchanged.

A slime plugin imports ``from slime.utils.types import Sample``, ``from slime.utils.http_utils
import post``, ``from slime.rollout.sglang_rollout import GenerateState`` and so on. When slime
itself is not installed, ``install()`` puts an import hook first on ``sys.meta_path`` that answers
``slime`` and ``slime.<x>`` with this package's ``slime_compat.<x>``: the very same module objects
(``slime.utils.types.Sample is buffer.sample.Sample``), so ``isinstance`` checks in plugins hold.
When slime is installed the hook is never installed: a real slime is never shadowed.

Only the modules and names slime's example plugins and its ``*_hub`` files import are provided
(docs/slime.md lists them); importing another ``slime.*`` module raises ``ModuleNotFoundError``
naming it. ``plugins.loader.load_function`` calls ``install()`` before it imports any plugin.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading

_lock = threading.Lock()
_installed: "_AliasFinder | None" = None


class _AliasLoader(importlib.abc.Loader):
    """Hands out the already imported ``slime_compat.<x>`` module as ``slime.<x>``."""

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
        real_name = "slime_compat" + fullname[len("slime"):]
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
        return not getattr(mod, "__name__", "").startswith("slime_compat")
    return importlib.util.find_spec("slime") is not None


def install() -> bool:
    """Expose this package as ``slime`` unless slime is installed; returns whether the hook is active.
    Idempotent and thread-safe."""
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
            if getattr(sys.modules[name], "__name__", "").startswith("slime_compat"):
                del sys.modules[name]
