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
import operator
import re
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
    group: Any = section(parser, title) if title else parser
    for f, spec in flag_fields(cls):
        if spec.group is not None:
            group = section(parser, spec.group)
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
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kw["required"] = True  # a field without a default: its flag must be given
        group.add_argument(flag_name(f), *spec.aliases, **kw)


def section(parser: argparse.ArgumentParser, title: str) -> Any:
    """The parser's argument group called ``title``, made on first use: parts share sections, and
    a part adding flags of its own to a section goes through here (``parser.add_argument_group``
    would make a second section of the same title in ``--help``)."""
    for g in parser._action_groups:  # argparse has no public lookup
        if g.title == title:
            return g
    return parser.add_argument_group(title)


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """``cls`` from the parsed flags; ``overrides`` set fields computed from several flags (or
    without one). Its own checks run once, as it is built (``__post_init__``); a
    :class:`SettingError` they raise comes out as the ``ValueError`` naming the flags
    (:meth:`SettingError.naming_flag`), so no part converts its errors itself."""
    values = {f.name: getattr(args, dest(f)) for f, _ in flag_fields(cls) if f.name not in overrides}
    try:
        return cls(**values, **overrides)
    except SettingError as e:
        raise e.naming_flag(cls) from None


_PLACEHOLDER = re.compile(r"\{([A-Za-z_]\w*)\}")


class SettingError(ValueError):
    """A bad setting, raised by a settings class's checks, naming its fields rather than flags.

    ``fields``: the bad field (or a tuple of them) of the settings class; ``message``: what is
    wrong, where ``{field_name}`` stands for any field of the class, e.g. ``"needs {lr_decay_steps}
    > 0"`` (a small renderer, not ``str.format``: braces around anything but a name are left
    alone). The text is ``"<fields>: <message>"``, or the message alone when it starts with one of
    its fields, e.g. ``f"{{lr}}={self.lr} must be > 0"``. ``str()`` writes each field as its name
    (settings built in code); :meth:`naming_flag` is the same error with each field written as its
    flag (settings built from flags: :func:`from_args` raises that one).
    """

    def __init__(self, fields: str | tuple[str, ...], message: str) -> None:
        self.fields = (fields,) if isinstance(fields, str) else tuple(fields)
        if not self.fields:
            raise TypeError("SettingError needs at least one field")
        self.field, self.message = self.fields[0], message  # field: the first (the one of a single-field error)
        super().__init__(self._render(lambda name: name))

    def naming_flag(self, cls: type) -> ValueError:
        """The error as a ``ValueError`` naming the flags of ``cls``'s fields (a field without a
        flag: its own name; a placeholder naming no field of ``cls``: left as written)."""
        names = {f.name for f in dataclasses.fields(cls)}

        def flag_or_name(name: str) -> str | None:
            if name not in names:
                return None
            try:
                return flag_of(cls, name)
            except KeyError:  # a field without a flag: its own name is the best there is
                return name

        return ValueError(self._render(flag_or_name))

    def _render(self, name: Callable[[str], str | None]) -> str:
        """The text with each field (its placeholder, and the leading ``fields``) written by ``name``."""
        message = _PLACEHOLDER.sub(lambda m: name(m.group(1)) or m.group(0), self.message)
        lead = _PLACEHOLDER.match(self.message)
        if lead and lead.group(1) in self.fields:
            return message
        return f"{', '.join(name(f) or f for f in self.fields)}: {message}"


def check_choice(settings: Any, name: str, allowed: tuple[str, ...]) -> None:
    """For a settings class's checks: a :class:`SettingError` when the field ``name`` is not one of
    ``allowed`` (argparse checks a flag's ``choices``; settings built in code are checked here),
    e.g. ``"dtype='fp8': expected one of auto, float32"`` (the flag, built from flags)."""
    value = getattr(settings, name)
    if value not in allowed:
        raise SettingError(name, "{" + name + "}" + f"={value!r}: expected one of {', '.join(allowed)}")


_BOUNDS = {">": operator.gt, ">=": operator.ge}


def check_bound(settings: Any, op: str, bound: float, *names: str) -> None:
    """For a settings class's checks: a :class:`SettingError` for the first of the fields ``names``
    that is set (not None) and not ``op bound`` (``op``: ``">"`` or ``">="``), e.g.
    ``check_bound(self, ">", 0, "lr")`` -> ``"lr must be > 0, got -1.0"`` (the flag, built from flags)."""
    for name in names:
        value = getattr(settings, name)
        if value is not None and not _BOUNDS[op](value, bound):
            raise SettingError(name, "{" + name + "}" + f" must be {op} {bound}, got {value}")
