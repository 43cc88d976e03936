"""The import graph of our packages, read with ``ast`` (nothing is imported): no circles between
modules nor between packages, each package imports only the layers below it, except the upward
edges listed (and justified) here and in docs/architecture.md ("Layers and import rules"), and no
package imports a private name (``_x``) of another: what crosses a package line is public API
(slime_compat reaches the rollout manager through ``rollout_manager.plugin_api``).

An import inside ``if TYPE_CHECKING:`` is not an edge (it never runs); an import inside a function
is one (it runs when the function does, and a circle through it still breaks a partial import).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Each package's layer: a package may import its own modules and those of a strictly lower layer.
LAYERS = {
    "flags": 0,  # one declaration per flag (settings fields -> argparse): imports nothing of ours
    "metric_keys": 0,  # the plotted metric keys and the plots: imports nothing of ours
    "sglang_protocol": 0,  # SGLang's protocol, ports, JSON: imports nothing of ours
    "plugins": 0,  # the plugin loader and the built-in plugins (rewards, filters)
    "embedded_engine": 1,  # SGLang stand-ins for CPU runs and tests: imports only sglang_protocol
    "buffer": 1,  # samples, the buffer actor; calls its filter plugin through plugins.loader
    "weight_sync": 2,
    "rollout_manager": 2,
    "train_backend": 3,  # its trainer group owns the WeightSender (weight_sync)
    "slime_compat": 4,  # slime's import paths, answered with everything below
    "examples": 5,  # user code (plugins loaded by path): imports anything, imported by none
}

#: Upward edges ``(importing module, imported module) -> why``; each must still exist. None left:
#: what lower packages took from slime_compat (the ``slime`` alias, slime's ``args`` names) lives in
#: plugins/, and the example plugin in examples/.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}

#: Circles that exist and must go (each listed so that a new one fails, and a fixed one is removed
#: from here). None left.
KNOWN_CIRCLES: list[set[str]] = []


def module_files(root: Path, packages) -> dict[str, Path]:
    """``dotted name -> file`` of every module under ``packages`` (a package is its ``__init__``)."""
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _resolve(name: str, modules) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``module -> modules of ours it imports`` (TYPE_CHECKING blocks skipped)."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out: set[str] = set()
        todo = list(ast.parse(path.read_text(), str(path)).body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                todo.extend(node.orelse)
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names]  # a submodule, else the module itself
            for t in targets:
                hit = _resolve(t, modules)
                if hit is not None and hit != name:
                    out.add(hit)
            todo.extend(ast.iter_child_nodes(node))
        edges[name] = out
    return edges


def circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(comp)
    return found


def _graph() -> dict[str, set[str]]:
    return import_edges(module_files(ROOT, LAYERS))


def test_no_import_circles_but_the_known_ones():
    found = circles(_graph())
    new = [sorted(c) for c in found if c not in KNOWN_CIRCLES]
    assert not new, f"import circles (break them; see docs/architecture.md): {new}"
    gone = [sorted(c) for c in KNOWN_CIRCLES if c not in found]
    assert not gone, f"no longer circles, remove them from KNOWN_CIRCLES: {gone}"


def test_packages_import_only_lower_layers_or_the_listed_upward_edges():
    bad, used = [], set()
    for src, targets in _graph().items():
        for dst in targets:
            a, b = src.split(".")[0], dst.split(".")[0]
            if a == b or LAYERS[b] < LAYERS[a]:
                continue
            if (src, dst) in ALLOWED_UPWARD:
                used.add((src, dst))
            else:
                bad.append(f"{src} -> {dst}")
    assert not bad, f"imports of a layer not below (docs/architecture.md, 'Layers and import rules'): {bad}"
    stale = sorted(set(ALLOWED_UPWARD) - used)
    assert not stale, f"ALLOWED_UPWARD entries no longer in the code (remove them): {stale}"


def package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """``package -> the other packages its modules import``."""
    out: dict[str, set[str]] = {}
    for src, targets in edges.items():
        a = src.split(".")[0]
        out.setdefault(a, set()).update(b for b in (t.split(".")[0] for t in targets) if b != a)
    return out


def test_no_circle_between_packages():
    found = circles(package_edges(_graph()))
    assert not found, f"packages that import each other (through any of their modules): {[sorted(c) for c in found]}"


def private_imports(modules: dict[str, Path]) -> list[str]:
    """``module: name`` for every import (function-local ones too) of a private name or module
    (``_x``, not ``__x__``) of another package of ours."""
    bad = []
    for name, path in modules.items():
        pkg = name.split(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                dotted = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                dotted = [a.name for a in node.names]
            else:
                continue
            for d in dotted:
                parts = d.split(".")
                if parts[0] in LAYERS and parts[0] != pkg and any(
                        x.startswith("_") and not x.startswith("__") for x in parts[1:]):
                    bad.append(f"{name}: {d}")
    return bad


def test_no_package_imports_a_private_name_of_another():
    bad = private_imports(module_files(ROOT, LAYERS))
    assert not bad, f"private names imported across packages (make them public API, or keep them home): {bad}"


def test_the_walker_finds_a_circle_through_a_function_import_and_skips_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    edges = import_edges(module_files(tmp_path, ["pkg"]))
    assert edges["pkg.b"] == {"pkg.a"} and edges["pkg.c"] == set() and edges["pkg.d"] == {"pkg.c"}
    assert circles(edges) == [{"pkg.a", "pkg.b"}]
    pkg_edges = package_edges({"a.x": {"b.y"}, "b.y": set(), "b.z": {"a.w"}, "a.w": set()})
    assert pkg_edges == {"a": {"b"}, "b": {"a"}} and circles(pkg_edges) == [{"a", "b"}]


def test_private_names_across_packages_are_found(tmp_path):
    for pkg, body in (("flags", "def _hidden(): pass\n"), ("buffer", "from flags import _hidden\n"),
                      ("plugins", "def f():\n    from flags._impl import x\n")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(body)
    found = private_imports(module_files(tmp_path, ["flags", "buffer", "plugins"]))
    assert sorted(found) == ["buffer: flags._hidden", "plugins: flags._impl.x"]
