"""bench/e2e.py --merge: a race split over several calls (a GPU machine's calls last 10 minutes: one
seed pair each) is aggregated as if it had run in one, files written before the race had tasks
(their keys named after the toy's 0.9) included; and the race's tasks refuse what they cannot run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "bench" / "e2e.py")
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)


def test_merging_split_seeds_gives_the_whole_runs_aggregate(tmp_path):
    whole = json.loads((ROOT / "bench/results/e2e.json").read_text())  # 5 seeds of 3 modes, one run
    parts = []
    old_names = {new: old for old, new in e2e._OLD_KEYS.items()}
    for i, seeds in enumerate(([1, 2], [3, 4, 5])):
        part = {**whole, "seeds": seeds, "command": f"part {i}",
                "metrics": {mode: {"seeds": [r for r in m["seeds"] if r["seed"] in seeds]}
                            for mode, m in whole["metrics"].items()}}
        if i == 0:  # a file of before the tasks: the toy's keys, no accuracy_target
            del part["accuracy_target"]
            part["metrics"] = {mode: {"seeds": [{old_names.get(k, k): v for k, v in r.items()} for r in m["seeds"]]}
                               for mode, m in part["metrics"].items()}
        (tmp_path / f"p{i}.json").write_text(json.dumps(part))
        parts.append(tmp_path / f"p{i}.json")
    out = tmp_path / "merged.json"
    e2e.main(["--merge", *map(str, parts), "--out", str(out)])
    merged = json.loads(out.read_text())
    assert merged["seeds"] == whole["seeds"] and merged["ratio"] == whole["ratio"]
    assert merged["ratio_from_first_step"] == pytest.approx(whole["ratio_from_first_step"], rel=1e-12)
    assert merged["accuracy_target"] == 0.9 and merged["task"] == "toy"
    for mode, m in whole["metrics"].items():
        got = merged["metrics"][mode]
        assert sorted(r["seed"] for r in got["seeds"]) == [1, 2, 3, 4, 5]
        for key in ("time_to_target_s", "steps_to_target", "final_accuracy", "startup_s", "reached"):
            assert got[key] == m[key], (mode, key)
    assert "part 0" in merged["command"] and "part 1" in merged["command"] and out.with_suffix(".png").is_file()
    (tmp_path / "other.json").write_text(json.dumps({**whole, "name": "e2e_gpu"}))
    try:
        e2e.main(["--merge", str(parts[0]), str(tmp_path / "other.json"), "--out", str(out)])
    except SystemExit as e:
        assert "different races" in str(e)
    else:
        raise AssertionError("merging two benchmarks' files must fail")


@pytest.mark.parametrize("argv, says", [
    (["--task", "smollm2", "--model-dir", "m"], "--task smollm2 runs on one GPU: add --gpu"),
    (["--task", "smollm2", "--gpu"], "--task smollm2 needs --model-dir"),
    (["--gpu", "--modes", "trl,async"], "--modes takes trl and sync only"),
])
def test_a_race_it_cannot_run_is_refused_naming_the_flag(argv, says, capsys, tmp_path):
    with pytest.raises(SystemExit):
        e2e.main([*argv, "--work-dir", str(tmp_path)])
    assert says in capsys.readouterr().err


def test_trls_math_rule_is_the_runs_math_reward():
    """The SmolLM2 race scores TRL's completions with --rm-type math's rule (plugins/rewards.py math_rm)."""
    import asyncio
    from types import SimpleNamespace

    from plugins.rewards import math_rm

    spec = importlib.util.spec_from_file_location("trl_grpo", ROOT / "bench" / "_trl_grpo.py")
    trl_side = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trl_side)  # imports no TRL at module level
    cases = [("56", "56"), ("10 + 46 = 56", "56"), ("The answer is 57.", "56"), ("\\boxed{115}", "115"),
             ("", "3"), ("56.0", "56"), ("5 6", "56")]
    for response, label in cases:
        sample = SimpleNamespace(response=response, label=label, index=0)
        assert trl_side.is_correct_math(response, label) == (asyncio.run(math_rm(None, sample)) == 1.0), response
