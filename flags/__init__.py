"""One declaration per flag: a settings dataclass field carries its command-line flag.

A part's settings dataclass declares each field with :func:`flag` (default, help, and where the
flag's name, choices or argparse action differ from what the field implies); :func:`add_flags`
makes the argparse flags from those fields and :func:`from_args` the settings from the parsed
namespace. So a flag's name, default, help and choices live in one place, next to the field they
set, and the mapping between them is never written out by hand::

    @dataclass
    class TrainSettings:
        lr: float = flag(1e-6, "peak learning rate")
        tis_cap: float = flag(2.0, "cap of the TIS weight", name="--tis-clip")  # slime's name

    add_flags(parser, TrainSettings)                   # --lr, --tis-clip
    settings = from_args(TrainSettings, args)          # TrainSettings(lr=args.lr, tis_cap=args.tis_clip)

Imports nothing of ours (every part uses it).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

_KEY = "reservoir_flag"


@dataclass(frozen=True)
class Flag:
    """How a field appears on the command line (see :func:`flag`)."""

    help: str = ""
    name: str | None = None  # default: "--" + the field's name with "-" for "_"
    choices: tuple | None = None
    type: Callable[[str], Any] | None = None  # default: from the field's annotation
    aliases: tuple[str, ...] = ()
    action: Any = None  # an argparse action; default: store_true for a bool defaulting to False
    nargs: str | None = None  # default: "+" for a list field
    group: str | None = None  # the --help section; default: the previous flag's
    declared_elsewhere: bool = False  # another part declares the flag; this field only reads it


def flag(default: Any = dataclasses.MISSING, help: str = "", *, name: str | None = None,
         choices: tuple | list | None = None, type: Callable[[str], Any] | None = None,
         aliases: tuple[str, ...] = (), action: Any = None, nargs: str | None = None, group: str | None = None,
         declared_elsewhere: bool = False, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field set by a command-line flag (arguments: :class:`Flag`'s)."""
    spec = Flag(help, name, tuple(choices) if choices is not None else None, type, tuple(aliases), action, nargs,
                group, declared_elsewhere)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_KEY: spec})


def flag_fields(cls: type) -> list[tuple[dataclasses.Field, Flag]]:
    """The fields of ``cls`` that have a flag, in declaration order."""
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def flag_name(f: dataclasses.Field) -> str:
    """The field's flag, e.g. ``--tis-clip``."""
    return f.metadata[_KEY].name or "--" + f.name.replace("_", "-")


def dest(f: dataclasses.Field) -> str:
    """Where argparse puts the field's value: the flag's name, slime's attribute name for plugins."""
    return flag_name(f)[2:].replace("-", "_")


def flag_of(cls: type, field_name: str) -> str:
    """The flag that sets ``cls.field_name`` (for error messages)."""
    for f, _ in flag_fields(cls):
        if f.name == field_name:
            return flag_name(f)
    raise KeyError(f"{cls.__name__}.{field_name} has no flag")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _type_of(annotation: str) -> Callable[[str], Any] | None:
    """int / float / str from an annotation string such as ``"int | None"`` or ``"list[int]"``."""
    base = {part.strip() for part in str(annotation).split("|")} - {"None"}
    if len(base) == 1:
        name = base.pop()
        if name.startswith("list[") and name.endswith("]"):
            name = name[5:-1]
        return {"int": int, "float": float, "str": str}.get(name)
    return None


def add_flags(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """Add a flag for each flagged field of ``cls`` (not those declared elsewhere), in sections
    named by :attr:`Flag.group` (``title`` until the first one names a section)."""
    group: Any = _section(parser, title) if title else parser
    for f, spec in flag_fields(cls):
        if spec.group is not None:
            group = _section(parser, spec.group)
        if spec.declared_elsewhere:
            continue
        kw: dict[str, Any] = {"dest": dest(f), "default": _default(f), "help": spec.help or None}
        is_bool = str(f.type).strip() in ("bool", "bool | None")
        if spec.action is not None:
            kw["action"] = spec.action
        elif is_bool:
            kw["action"] = "store_true" if f.default is False else argparse.BooleanOptionalAction
        if not is_bool:
            kw["type"] = spec.type or _type_of(f.type)
        if spec.nargs is not None or (str(f.type).startswith("list[") and spec.action is None):
            kw["nargs"] = spec.nargs or "+"
        if spec.choices is not None:
            kw["choices"] = spec.choices
        group.add_argument(flag_name(f), *spec.aliases, **kw)


def _section(parser: argparse.ArgumentParser, title: str) -> Any:
    """The parser's argument group called ``title`` (made on first use: parts share sections)."""
    for g in parser._action_groups:  # argparse has no public lookup
        if g.title == title:
            return g
    return parser.add_argument_group(title)


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """``cls`` from the parsed flags; ``overrides`` set fields computed from several flags (or
    without one). Its own checks (``__post_init__``) run as usual."""
    values = {f.name: getattr(args, dest(f)) for f, _ in flag_fields(cls) if f.name not in overrides}
    return cls(**values, **overrides)


class SettingError(ValueError):
    """A bad setting, raised by a settings class's checks: ``field`` names it, ``message`` says
    what is wrong (``str()``: both). Where the settings came from flags, :meth:`naming_flag` is the
    same error naming the flag instead of the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def naming_flag(self, cls: type) -> ValueError:
        try:
            return ValueError(f"{flag_of(cls, self.field)}: {self.message}")
        except KeyError:  # a field without a flag: its own name is the best there is
            return ValueError(str(self))
