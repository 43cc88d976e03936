"""bench/step_overhead.py's runner: a run's child keeps the caller's PYTHONPATH (on the GPU machine
SGLang, Ray and megatron come from there), and one failed run (a variant's bad engine flag) is
reported and left out instead of losing the runs before and after it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_step_overhead", ROOT / "bench" / "step_overhead.py")
so = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(so)


def test_the_child_keeps_the_callers_pythonpath_behind_the_tree(tmp_path, monkeypatch):
    seen = {}

    def fake_run(cmd, cwd, env, **kw):
        seen.update(env=env, cwd=cwd)
        (tmp_path / "work" / "child.json").write_text("{}")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setenv("PYTHONPATH", "/opt/sgl-site:/opt/bundle")
    monkeypatch.setattr(so.subprocess, "run", fake_run)
    so._run_once(tmp_path / "tree", 2, tmp_path / "work", False, [], "cfg.yaml")
    assert seen["env"]["PYTHONPATH"].split(":") == [str(tmp_path / "tree"), "/opt/sgl-site", "/opt/bundle"]
    monkeypatch.delenv("PYTHONPATH")
    so._run_once(tmp_path / "tree", 2, tmp_path / "work", False, [], "cfg.yaml")
    assert seen["env"]["PYTHONPATH"] == str(tmp_path / "tree")


def test_a_failed_run_is_reported_and_the_others_are_kept(tmp_path, monkeypatch, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(so, "MODEL", model)
    monkeypatch.setattr(so, "_tree_of", lambda rev, into: into)

    def fake_run_once(tree, steps, work, profile, extra, config):
        if "--bad-flag" in extra:
            raise RuntimeError("run failed (2): unrecognized arguments: --bad-flag")
        return {"name": work.name}

    monkeypatch.setattr(so, "_run_once", fake_run_once)
    monkeypatch.setattr(so, "summarize", lambda child, warmup: {"step_ms/step": 80.0, "step_ms/wall": 82.0,
                                                               "startup/total_to_loop_s": 10.0})
    out = tmp_path / "so.json"
    so.main(["--repeats", "2", "--variant", "bad=--bad-flag", "--variant", "good=--seed 2", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["failed_runs"] == ["bad 0", "bad 1"]
    assert sorted(doc["metrics"]) == ["good", "head"]
    assert doc["metrics"]["good"]["step_ms/wall"]["runs"] == [82.0, 82.0]
    assert "[bad 0] FAILED: run failed (2): unrecognized arguments: --bad-flag" in capsys.readouterr().out
