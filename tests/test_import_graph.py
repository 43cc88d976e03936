"""The import graph of our packages and of ``scripts/``, read with ``ast`` (nothing is imported): no
circle at all, of any length, between modules nor between packages; each package imports only the
layers below it, except the upward edges listed here with their reason (and that reason written
as a comment next to the import, and in docs/architecture.md, "Layers and import rules"); and no
package imports a private name (``_x``) of another: what crosses a package line is public API
(slime_compat reaches the rollout manager through ``rollout_manager.plugin_api``).

An import inside ``if TYPE_CHECKING:`` is not an edge (it never runs); an import inside a function
is one (it runs when the function does, and a circle through it still breaks a partial import).
``scripts/`` is a package like the others (``scripts.producer``): no module imports one of its
files by bare name (``from producer import ...``), which would work only where ``scripts/`` itself
is on ``sys.path``.
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
    "ray_cluster": 0,  # Ray helpers the engines' and the trainer ranks' placement share: imports nothing of ours
    "embedded_engine": 1,  # SGLang stand-ins for CPU runs and tests: imports only flags and sglang_protocol
    "buffer": 1,  # samples, the buffer actor; calls its filter plugin through plugins.loader
    "weight_sync": 2,
    "rollout_manager": 2,
    "train_backend": 3,  # its trainer group owns the WeightSender (weight_sync)
    "slime_compat": 4,  # slime's import paths, answered with everything below
    "examples": 5,  # user code (plugins loaded by path): imports anything, imported by none
    "scripts": 6,  # the launcher and its tools: imports anything, imported by no package
}
#: Upward edges ``(importing module, imported module) -> why``; each must still exist, and each of
#: its import statements must carry a comment saying why (on its line or the line above). None
#: left: what lower packages took from slime_compat (the ``slime`` alias, slime's ``args`` names)
#: lives in plugins/, and the example plugin in examples/.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


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


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that the dotted ``name`` (a module, or a name in one) is, else None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_sites(modules: dict[str, Path]) -> dict[tuple[str, str], list[int]]:
    """``(module, module of ours it imports) -> the lines of those imports`` (TYPE_CHECKING blocks
    skipped; imports inside functions, classes, ``try`` or ``if`` included)."""
    sites: dict[tuple[str, str], list[int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
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
                    sites.setdefault((name, hit), []).append(node.lineno)
            todo.extend(ast.iter_child_nodes(node))
    return sites


def import_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``module -> modules of ours it imports`` (see :func:`import_sites`)."""
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for src, dst in import_sites(modules):
        edges[src].add(dst)
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


def test_the_graph_covers_every_package_and_scripts():
    modules = module_files(ROOT, LAYERS)
    assert {m.split(".")[0] for m in modules} == set(LAYERS)
    on_disk = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert on_disk - {"tests", "bench"} <= set(LAYERS), f"packages without a layer: {on_disk - set(LAYERS)}"
    assert "scripts.producer" in _graph()["scripts.components"]  # an import between scripts


def test_no_import_circles():
    found = circles(_graph())
    assert not found, (f"modules that import each other (function-local imports count; move the shared piece "
                       f"down, or pass it as an argument): {[sorted(c) for c in found]}")


def upward_imports(modules: dict[str, Path], allowed: dict[tuple[str, str], str]) -> tuple[list[str], list[str]]:
    """Imports of a layer not below: those not in ``allowed`` and those in it without a comment on
    their line or the one above (the reason, written where the import is); then ``allowed`` entries
    no longer in the code."""
    bad, used = [], set()
    for (src, dst), lines in sorted(import_sites(modules).items()):
        a, b = src.split(".")[0], dst.split(".")[0]
        if a == b or LAYERS[b] < LAYERS[a]:
            continue
        if (src, dst) not in allowed:
            bad.append(f"{src} -> {dst}")
            continue
        used.add((src, dst))
        text = modules[src].read_text().splitlines()
        for n in lines:
            if "#" not in text[n - 1] and not (n > 1 and text[n - 2].strip().startswith("#")):
                bad.append(f"{src}:{n} -> {dst}: no comment saying why")
    return bad, sorted(set(allowed) - used)


def test_packages_import_only_lower_layers_or_the_listed_upward_edges():
    bad, stale = upward_imports(module_files(ROOT, LAYERS), ALLOWED_UPWARD)
    assert not bad, f"imports of a layer not below (docs/architecture.md, 'Layers and import rules'): {bad}"
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
    (pkg / "e.py").write_text("import pkg.f\n")  # a longer circle, through a class body and a try
    (pkg / "f.py").write_text("class C:\n    def m(self):\n        try:\n            from pkg import g\n"
                              "        except ImportError:\n            pass\n")
    (pkg / "g.py").write_text("def f():\n    if True:\n        import pkg.e\n")
    found = circles(import_edges(module_files(tmp_path, ["pkg"])))
    assert sorted(map(sorted, found)) == [["pkg.a", "pkg.b"], ["pkg.e", "pkg.f", "pkg.g"]]
    pkg_edges = package_edges({"a.x": {"b.y"}, "b.y": set(), "b.z": {"a.w"}, "a.w": set()})
    assert pkg_edges == {"a": {"b"}, "b": {"a"}} and circles(pkg_edges) == [{"a", "b"}]


def test_private_names_across_packages_are_found(tmp_path):
    for pkg, body in (("flags", "def _hidden(): pass\n"), ("buffer", "from flags import _hidden\n"),
                      ("plugins", "def f():\n    from flags._impl import x\n")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(body)
    found = private_imports(module_files(tmp_path, ["flags", "buffer", "plugins"]))
    assert sorted(found) == ["buffer: flags._hidden", "plugins: flags._impl.x"]


def bare_script_imports(root: Path, files: list[Path]) -> list[str]:
    """``file:line: name`` for every import (function-local ones too) of a file of ``scripts/`` by
    its bare name (``import arguments``): it finds the file only where ``scripts/`` itself is on
    ``sys.path``, and shadows any library module of that name there."""
    names = {f.stem for f in (root / "scripts").glob("*.py")} - {"__init__"}
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                dotted = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                dotted = [node.module]
            else:
                continue
            bad += [f"{path.relative_to(root)}:{node.lineno}: {d}" for d in dotted if d.split(".")[0] in names]
    return bad


def test_scripts_are_imported_as_a_package():
    files = [*module_files(ROOT, LAYERS).values(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]
    bad = bare_script_imports(ROOT, files)
    assert not bad, f"files of scripts/ imported by bare name (import them as scripts.<name>): {bad}"


def test_bare_names_of_scripts_and_upward_imports_without_a_reason_are_found(tmp_path):
    for pkg in ("flags", "buffer", "scripts"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "scripts" / "one.py").write_text("import flags\nfrom scripts import two\n")
    (tmp_path / "scripts" / "two.py").write_text("def f():\n    from scripts.one import x\n")
    (tmp_path / "flags" / "up.py").write_text("import buffer  # the reason\n\ndef f():\n    import buffer\n")
    (tmp_path / "buffer" / "up.py").write_text("def f():\n    import scripts_not_ours\n    from scripts.one import y\n")
    (tmp_path / "buffer" / "bare.py").write_text("import two\n\ndef f():\n    from one.x import y\n")
    modules = module_files(tmp_path, ["flags", "buffer", "scripts"])
    edges = import_edges(modules)
    assert edges["scripts.one"] == {"flags", "scripts.two"} and edges["buffer.up"] == {"scripts.one"}
    assert circles(edges) == [{"scripts.one", "scripts.two"}]
    bad, stale = upward_imports(modules, {("flags.up", "buffer"): "a reason", ("flags", "buffer"): "gone"})
    assert bad == ["buffer.up -> scripts.one", "flags.up:4 -> buffer: no comment saying why"]
    assert stale == [("flags", "buffer")]
    assert sorted(bare_script_imports(tmp_path, list(modules.values()))) == ["buffer/bare.py:1: two",
                                                                            "buffer/bare.py:4: one.x"]
