"""bench/e2e.py --merge: a race split over several calls (a GPU machine's calls last 10 minutes: one
seed pair each) is aggregated as if it had run in one."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "bench" / "e2e.py")
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)


def test_merging_split_seeds_gives_the_whole_runs_aggregate(tmp_path):
    whole = json.loads((ROOT / "bench/results/e2e.json").read_text())  # 5 seeds of 3 modes, one run
    parts = []
    for i, seeds in enumerate(([1, 2], [3, 4, 5])):
        part = {**whole, "seeds": seeds, "command": f"part {i}",
                "metrics": {mode: {"seeds": [r for r in m["seeds"] if r["seed"] in seeds]}
                            for mode, m in whole["metrics"].items()}}
        (tmp_path / f"p{i}.json").write_text(json.dumps(part))
        parts.append(tmp_path / f"p{i}.json")
    out = tmp_path / "merged.json"
    e2e.main(["--merge", *map(str, parts), "--out", str(out)])
    merged = json.loads(out.read_text())
    assert merged["seeds"] == whole["seeds"] and merged["ratio"] == whole["ratio"]
    for mode, m in whole["metrics"].items():
        got = merged["metrics"][mode]
        assert sorted(r["seed"] for r in got["seeds"]) == [1, 2, 3, 4, 5]
        for key in ("time_to_0.9_s", "steps_to_0.9", "final_accuracy", "startup_s", "reached"):
            assert got[key] == m[key], (mode, key)
    assert "part 0" in merged["command"] and "part 1" in merged["command"] and out.with_suffix(".png").is_file()
    (tmp_path / "other.json").write_text(json.dumps({**whole, "name": "e2e_gpu"}))
    try:
        e2e.main(["--merge", str(parts[0]), str(tmp_path / "other.json"), "--out", str(out)])
    except SystemExit as e:
        assert "different benchmarks" in str(e)
    else:
        raise AssertionError("merging two benchmarks' files must fail")
