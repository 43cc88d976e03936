"""flags: one declaration per flag, and one settings error type (SettingError) that names the bad fields,
written as their flags where the settings came from flags and as field names where they were built in code."""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import textwrap
from dataclasses import dataclass, fields

import pytest

import buffer.settings
import embedded_engine.settings
import rollout_manager.settings
import train_backend.settings
from buffer.settings import BufferSettings
from embedded_engine.settings import EngineSettings
from flags import SettingError, add_flags, flag, from_args
from rollout_manager.__main__ import CliSettings
from rollout_manager.settings import (DataSettings, EngineFleetSettings, PluginSettings, RolloutLoopSettings,
                                      RolloutSettings, SamplingSettings)
from scripts.arguments import LauncherSettings
from train_backend.megatron.arguments import MegatronSettings
from train_backend.settings import TrainSettings


@dataclass
class _Toy:
    cap: float = flag(2.0, name="--toy-clip")
    steps: int = flag(0)
    derived: int = 1  # no flag

    def __post_init__(self) -> None:  # as every settings class: checked once, as it is built
        self.validate()

    def validate(self) -> None:
        if self.cap <= 0:
            raise SettingError("cap", f"{{cap}}={self.cap} must be > 0")
        if self.steps < 0:
            raise SettingError(("steps", "derived"), f"{self.steps}: needs {{cap}} and {{derived}}; {{'a': 1}} {{0}}")


def _toy_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_flags(p, _Toy)
    return p.parse_args(list(argv))


def test_setting_error_renders_fields_as_flags_or_names():
    e = SettingError("cap", "{cap}=0 must be > 0")  # starts with its field: no prefix
    assert str(e) == "cap=0 must be > 0" and e.field == "cap" and e.fields == ("cap",)
    assert str(e.naming_flag(_Toy)) == "--toy-clip=0 must be > 0"
    e = SettingError(("steps", "derived"), "-1: needs {cap} > 0, not {'a': 1} {0} {unknown}")
    assert str(e) == "steps, derived: -1: needs cap > 0, not {'a': 1} {0} unknown"
    # a field without a flag keeps its name; a placeholder naming no field of the class is left as written
    assert str(e.naming_flag(_Toy)) == "--steps, derived: -1: needs --toy-clip > 0, not {'a': 1} {0} {unknown}"
    assert isinstance(e, ValueError) and type(e.naming_flag(_Toy)) is ValueError
    # weight_sync's form: one field, a message without placeholders
    assert str(SettingError("steps", "-1: must be >= 0")) == "steps: -1: must be >= 0"
    assert str(SettingError("steps", "-1: must be >= 0").naming_flag(_Toy)) == "--steps: -1: must be >= 0"


def test_from_args_raises_errors_naming_the_flags():
    with pytest.raises(ValueError, match=r"^--toy-clip=0.0 must be > 0$") as e:
        from_args(_Toy, _toy_args("--toy-clip", "0"))
    assert not isinstance(e.value, SettingError)
    with pytest.raises(ValueError, match=r"^--steps, derived: -1: needs --toy-clip and derived; "):
        from_args(_Toy, _toy_args("--steps", "-1"))
    with pytest.raises(SettingError, match=r"^cap=0 must be > 0$"):  # built in code: the field's name
        _Toy(cap=0)


def test_cli_errors_name_the_declared_flag(toy_model_dir, capsys):
    """Through the launcher: the flags declared by the fields (``--lr-warmup-iters`` sets
    ``lr_warmup_steps``, ``--tis-clip`` sets ``tis_cap``), with the values given."""
    from scripts.arguments import parse_args

    base = ["--hf-checkpoint", str(toy_model_dir), "--prompt-data", str(toy_model_dir / "data/train.jsonl")]
    for extra, msg in ((["--lr-warmup-iters", "-1"], "--lr-warmup-iters=-1 must be >= 0"),
                       (["--tis-clip", "0"], "--tis-clip=0.0 must be > 0"),
                       (["--buffer-capacity", "0"], "--buffer-capacity must be >= 1, got 0"),
                       (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1"),
                       (["--update-weight-buffer-size", "0"], "--update-weight-buffer-size: 0: must be > 0")):
        with pytest.raises(SystemExit):
            parse_args(base + extra)
        assert msg in capsys.readouterr().err


def test_settings_built_in_code_name_the_field():
    with pytest.raises(SettingError, match=r"^tis_cap=0 must be > 0$"):
        TrainSettings(hf_checkpoint="m", tis_cap=0)
    with pytest.raises(SettingError, match=r"^lr_decay_style=cosine needs lr_decay_steps > 0$") as e:
        TrainSettings(hf_checkpoint="m", lr_decay_style="cosine")
    assert e.value.fields == ("lr_decay_style", "lr_decay_steps")
    with pytest.raises(SettingError, match=r"^capacity must be >= 1, got 0$"):
        BufferSettings(capacity=0).validate()
    with pytest.raises(SettingError, match=r"^sequence_parallel needs tensor_model_parallel_size > 1$"):
        MegatronSettings(sequence_parallel=True)


# Settings classes whose checks name fields (SettingError), never flags written by hand
_CONVERTED = (TrainSettings, MegatronSettings, BufferSettings, DataSettings, EngineFleetSettings, SamplingSettings,
              PluginSettings, RolloutSettings, RolloutLoopSettings, LauncherSettings, CliSettings, EngineSettings)


@pytest.mark.parametrize("cls", _CONVERTED, ids=lambda c: c.__name__)
def test_settings_checks_write_no_flag_by_hand(cls):
    """Every ``raise`` in the class (its ``__post_init__``, ``validate`` and their helpers) raises a
    SettingError whose strings hold no ``--flag``: flags come from the fields' declarations, and
    each ``{placeholder}`` names a field of the class."""
    _check_raises(textwrap.dedent(inspect.getsource(cls)), cls.__name__, {f.name for f in fields(cls)})


@pytest.mark.parametrize("module", [rollout_manager.settings, train_backend.settings, buffer.settings,
                                    embedded_engine.settings],
                         ids=lambda m: m.__name__)
def test_settings_modules_write_no_flag_by_hand(module):
    """The same for a whole settings module, its check helpers outside the classes too (the rollout
    settings' ``_positive``: their placeholders are built from the names they are given)."""
    _check_raises(inspect.getsource(module), module.__name__)


def _check_raises(source: str, what: str, names: set[str] | None = None) -> None:
    """Every ``raise`` in ``source`` raises a SettingError with no ``--`` in its strings (and, given
    the fields' ``names``, no placeholder naming another)."""
    raises = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Raise) and node.exc is not None]
    for node in raises:
        where = f"{what}, line {node.lineno}: {ast.unparse(node)[:100]}"
        assert isinstance(node.exc, ast.Call) and ast.unparse(node.exc.func) == "SettingError", where
        for s in ast.walk(node.exc):
            if isinstance(s, ast.Constant) and isinstance(s.value, str):
                assert "--" not in s.value, f"a flag written by hand: {where}"
                if names is not None:
                    unknown = set(re.findall(r"\{([A-Za-z_]\w*)\}", s.value)) - names
                    assert not unknown, f"placeholders naming no field ({unknown}): {where}"
