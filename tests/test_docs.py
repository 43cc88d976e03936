"""The pages under docs/ that are checked against the code: docs/flags.md is generated from the
flag declarations, docs/walkthrough.md names only files and functions that exist, and
bench/RESULTS.md is generated from the result files and bench/NOTES.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_flags_page_is_current():
    """docs/flags.md is what scripts/flags_doc.py prints from the declarations (a changed flag
    regenerates it), and lists every flag of the three entry points."""
    import rollout_manager.__main__ as standalone
    from embedded_engine.settings import build_parser as engine_parser
    from scripts import flags_doc
    from scripts.arguments import build_parser

    page = (ROOT / "docs/flags.md").read_text()
    assert page == flags_doc.render(), f"docs/flags.md is stale: regenerate it with `{flags_doc.COMMAND}`"
    for parser in (build_parser(), standalone.build_parser(), engine_parser()):
        missing = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"
                   and f"`{o}`" not in page]
        assert missing == [], f"{parser.prog}: flags missing from docs/flags.md: {missing}"


def test_walkthrough_names_real_files_and_functions():
    """Every `path.py` in docs/walkthrough.md exists, and every `f()` / `Class.method()` is defined
    in the file named right after it (`f()` of `file.py`, `f()` and `g()` of `file.py`), or else in
    the file named last before it."""
    text = (ROOT / "docs/walkthrough.md").read_text()
    current, problems, functions = None, [], 0
    for m in re.finditer(r"`([^`]+)`", text):
        name = m.group(1)
        if name.endswith(".py"):
            current = name
            if not (ROOT / name).is_file():
                problems.append(f"{name}: no such file")
            continue
        if not re.fullmatch(r"[A-Za-z_][\w.]*\(\)", name):
            continue
        # "`f()` of `file.py`", "`f()`, `g()` and `h()` of `file.py`"
        of = re.match(r"(?:,?\s+(?:and\s+)?`[^`]+\(\)`)*\s+of\s+`([^`]+\.py)`", text[m.end():])
        where = of.group(1) if of else current
        source = (ROOT / where).read_text() if where and (ROOT / where).is_file() else ""
        *owner, fn = name[:-2].split(".")
        for kind, ident in [("class", o) for o in owner] + [("def", fn)]:
            if not re.search(rf"^\s*(async\s+)?{kind}\s+{re.escape(ident)}\b", source, re.M):
                problems.append(f"{name}: no {kind} {ident} in {where}")
        functions += 1
    assert functions > 50 and problems == [], "\n".join(problems)


def test_bench_results_page_is_current():
    """bench/RESULTS.md is what bench/write_results.py renders from bench/results/*.json and
    bench/NOTES.md: a note written straight into RESULTS.md is lost at the next regeneration."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("write_results", ROOT / "bench/write_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "bench/RESULTS.md").read_text() == module.render(), \
        "bench/RESULTS.md is stale or edited by hand: write notes into bench/NOTES.md, then run `python bench/write_results.py`"
