"""Print docs/flags.md: every flag of the three entry points, read from their parsers (so from the
flags' one declaration each, :mod:`flags`), grouped as ``--help`` groups them::

    python scripts/flags_doc.py > docs/flags.md

``tests/test_flags.py`` fails when the committed page differs from what this prints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: Python put scripts/ first on sys.path; the repo root instead,
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # so its siblings import as scripts.x (scripts/__init__.py)

COMMAND = "python scripts/flags_doc.py > docs/flags.md"

_HEADER = f"""# Flags

Every flag of `scripts/train.py`, of `python -m rollout_manager` and of `python -m embedded_engine`
(the CPU engine the fleet starts), grouped as their `--help` groups them; an empty default is none. Generated from the flag declarations (the settings
dataclasses' `flag(...)` fields): edit those, not this page, and regenerate it with
`{COMMAND}`. SGLang's own flags pass through as `--sglang-<flag>`,
sglang-router's as `--sglang-router-<flag>` (`rollout_manager/arguments.py`); in a `--config` file
as `sglang-<flag>:` keys (a list for several values, `true` for a bare flag; `scripts/config.py`).
"""

def _type(a: argparse.Action) -> str:
    """What the flag takes: ``switch`` (no value), ``bool`` (``--x`` / ``--no-x``), its choices, or its type."""
    if isinstance(a, argparse.BooleanOptionalAction):
        return "bool"
    if a.nargs == 0:
        return "switch"
    kind = " \\| ".join(map(str, a.choices)) if a.choices else getattr(a.type, "__name__", "str")
    if a.nargs in ("+", "*"):
        return f"{kind} ..."
    return f"{kind}, repeatable" if isinstance(a, argparse._AppendAction) else kind


def _default(value: object) -> str:
    return "" if value is None else f"`{value!r}`" if value == "" else f"`{value}`"


def _table(actions: list[argparse.Action]) -> list[str]:
    rows = ["| flag | takes | default | what it sets |", "|---|---|---|---|"]
    for a in actions:
        flags = ", ".join(f"`{o}`" for o in a.option_strings)
        rows.append(f"| {flags} | {_type(a)} | {_default(a.default)} | {(a.help or '').replace('|', chr(92) + '|')} |")
    return rows


def _groups(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    """The parser's sections (``--help``'s order), each with its flags (not ``--help``)."""
    groups = {g.title: [a for a in g._group_actions if not isinstance(a, argparse._HelpAction)]
              for g in parser._action_groups}  # argparse has no public list of them
    return {title: actions for title, actions in groups.items() if actions}


def _signature(actions: list[argparse.Action]) -> list[tuple]:
    return [(a.option_strings, _type(a), a.default, a.help) for a in actions]


def render() -> str:
    """The page: the launcher's sections, then the standalone rollout command's (those equal to the
    launcher's named only), then the embedded engine's flags."""
    import rollout_manager.__main__ as standalone
    from embedded_engine.settings import build_parser as engine_parser
    from scripts.arguments import build_parser

    launcher = _groups(build_parser())
    lines = [_HEADER, "## `scripts/train.py`\n"]
    for title, actions in launcher.items():
        lines += [f"### {title}\n", *_table(actions), ""]
    lines.append("## `python -m rollout_manager`\n")
    same = []
    for title, actions in _groups(standalone.build_parser()).items():
        if title in launcher and _signature(launcher[title]) == _signature(actions):
            same.append(title)
        else:
            lines += [f"### {title}\n", *_table(actions), ""]
    if same:
        lines += ["The sections " + ", ".join(f"*{t}*" for t in same) + " as for `scripts/train.py` above.", ""]
    lines.append("## `python -m embedded_engine`\n")
    for actions in _groups(engine_parser()).values():
        lines += [*_table(actions), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
