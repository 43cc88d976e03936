"""The buffer's flags: defaults from BufferSettings, validation errors that name the flag."""

from __future__ import annotations

import argparse
import sys
import types

import pytest

from buffer.arguments import add_arguments, settings_from_args
from buffer.interfaces import BufferSettings


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--n-samples-per-prompt", type=int, default=4)  # the rollout manager's flag
    add_arguments(p)
    return p.parse_args(argv)


def test_defaults_come_from_the_settings():
    s = settings_from_args(parse([]))
    assert s == BufferSettings(n_samples_per_prompt=4)


def test_flags_map_to_settings(tmp_path, monkeypatch):
    mod = types.ModuleType("buffer_flag_filters")
    mod.pop = lambda args, rollout_id, buffer, num_samples: buffer[:num_samples]
    monkeypatch.setitem(sys.modules, "buffer_flag_filters", mod)
    s = settings_from_args(parse([
        "--buffer-capacity", "8", "--buffer-put-timeout", "2.5", "--buffer-get-timeout", "9",
        "--max-weight-staleness", "0", "--stale-policy", "return", "--buffer-dir", str(tmp_path),
        "--buffer-filter-path", "buffer_flag_filters.pop", "--buffer-fsync"]))
    assert s == BufferSettings(n_samples_per_prompt=4, capacity=8, put_timeout_s=2.5, get_timeout_s=9.0,
                               max_weight_staleness=0, stale_policy="return", persist_dir=str(tmp_path),
                               filter_path="buffer_flag_filters.pop", fsync=True)


@pytest.mark.parametrize("argv,flag", [
    (["--buffer-capacity", "0"], "--buffer-capacity"),
    (["--buffer-put-timeout", "-1"], "--buffer-put-timeout"),
    (["--buffer-get-timeout", "0"], "--buffer-get-timeout"),
    (["--max-weight-staleness", "-2"], "--max-weight-staleness"),
    (["--buffer-fsync"], "--buffer-fsync"),
    (["--buffer-filter-path", "no_such_module.pop"], "--buffer-filter-path"),
    (["--buffer-filter-path", "os.getcwd"], "--buffer-filter-path"),  # wrong signature
])
def test_bad_flags_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        settings_from_args(parse(argv))


def test_unknown_stale_policy_is_refused_by_argparse():
    with pytest.raises(SystemExit):
        parse(["--stale-policy", "keep"])
