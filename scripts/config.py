"""``--config FILE.yaml``: defaults for any flag; the command line overrides them.

Keys are flag names without the leading dashes, with ``-`` or ``_`` (``rollout-batch-size`` or
``rollout_batch_size``). An unknown key, or a value of the wrong type, is an error that names
the file, the line and the flag. Keys starting with ``sglang-`` that are not flags of ours are
SGLang's (and ``sglang-router-``'s) pass-through flags, as on the command line
(``sglang-attention-backend: triton``, ``sglang-cuda-graph-bs-decode: [1, 2, 4]``,
``sglang-enable-memory-saver: true``): :func:`passthrough_tokens` turns them into those tokens.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path
from typing import Any

import yaml


PASSTHROUGH_PREFIX = "sglang-"


def load_config_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """Read ``path`` and return ``{dest: value}`` for ``parser.set_defaults``, checked per key
    (pass-through ``sglang-`` keys aside: :func:`passthrough_tokens` reads them)."""
    data, lines = _read(path)
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    out: dict[str, Any] = {}
    for key, value in data.items():
        where = f"--config {path}, line {lines.get(key, '?')}"
        dest = str(key).lstrip("-").replace("-", "_")
        action = actions.get(dest)
        if action is None and _is_passthrough(key):
            ours = [a.option_strings[-1] for a in actions.values() if _is_passthrough(a.option_strings[-1][2:])]
            close = difflib.get_close_matches("--" + str(key).lstrip("-").replace("_", "-"), ours, n=1, cutoff=0.93)
            if close:  # a typo of one of our --sglang- flags would otherwise go to SGLang
                raise ValueError(f"{where}: unknown flag '--{str(key).lstrip('-')}' (did you mean {close[0]}?)")
            continue
        if action is None or dest in ("config", "help"):
            flag = f"--{str(key).lstrip('-').replace('_', '-')}"
            close = difflib.get_close_matches(flag, [a.option_strings[-1] for a in actions.values()], n=1, cutoff=0.75)
            raise ValueError(f"{where}: unknown flag '{flag}'" + (f" (did you mean {close[0]}?)" if close else ""))
        out[dest] = _coerce(action, value, where, key)
    return out


def passthrough_tokens(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The config's ``sglang-`` keys that are not flags of ``parser``, as command-line tokens
    (``--sglang-X VALUE...``; ``true`` gives the bare flag, ``false`` or null leaves it out), in the
    file's order. The command line's own ``--sglang-`` flags go after them, so they win."""
    data, lines = _read(path)
    dests = {a.dest for a in parser._actions if a.option_strings}
    tokens: list[str] = []
    for key, value in data.items():
        if str(key).lstrip("-").replace("-", "_") in dests or not _is_passthrough(key):
            continue
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        items = value if isinstance(value, list) else [value]
        if value is False or value is None:
            continue
        if any(isinstance(v, (list, dict)) or v is None for v in items):
            raise ValueError(f"--config {path}, line {lines.get(key, '?')}: {flag} expects a value or a list of "
                             f"single values, got {value!r}")
        tokens.append(flag)
        if value is not True:
            tokens += [str(v).lower() if isinstance(v, bool) else str(v) for v in items]
    return tokens


def _is_passthrough(key: Any) -> bool:
    return str(key).lstrip("-").replace("_", "-").startswith(PASSTHROUGH_PREFIX)


def _read(path: str) -> tuple[dict[Any, Any], dict[Any, int]]:
    """The file's top-level mapping and each key's line; ``ValueError`` naming the file."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path}: no such file")
    text = file.read_text()
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML: {e}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values at the top level")
    lines = {k.value: k.start_mark.line + 1 for k, _ in node.value} if node is not None else {}
    return data, lines


def _coerce(action: argparse.Action, value: Any, where: str, key: str) -> Any:
    """Apply the flag's own type/choices to a YAML value, so YAML and CLI behave alike."""
    flag = action.option_strings[-1]
    if value is None:
        return None
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                           argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {flag} expects true or false, got {value!r}")
        return value
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value]
        return [_convert(action, v, where, flag, key) for v in items]
    return _convert(action, value, where, flag, key)


def _convert(action: argparse.Action, value: Any, where: str, flag: str, key: str) -> Any:
    """One value of ``flag``: a list or mapping is never one (``lr: [0.1]`` must not reach the
    optimizer as a list; a flag taking several values gets each item here)."""
    if isinstance(value, (list, dict)):
        kind = "a list" if isinstance(value, list) else "a mapping"
        want = getattr(action.type, "__name__", "a string") if action.type is not None else "a string"
        several = action.nargs in ("*", "+") or isinstance(action.nargs, int)
        raise ValueError(f"{where}: key '{key}' ({flag}) expects {'a list of single values' if several else 'one value'} "
                         f"({want}), got {kind}: {value!r}")
    if action.type is int and isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{where}: {flag} expects an integer, got {value!r}")
    if action.type is not None and not (isinstance(value, bool) and action.type is not bool):
        try:
            value = action.type(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {flag}: {e}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: {flag} must be one of {list(action.choices)}, got {value!r}")
    return value
