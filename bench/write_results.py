"""Regenerate bench/RESULTS.md from bench/results/*.json (each benchmark writes its own JSON).

    python bench/write_results.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return "" if v is None else str(v)


def _time_ratios(r: dict) -> str:
    """A benchmark's time ratios beside its main one: ``time_ratio`` (weight_sync_delta: the pause,
    what generation loses) and ``total_ratio`` (the whole call, the trainer's side too)."""
    parts = [f"{label} {r[key]:.2f}" for key, label in (("time_ratio", "pause"), ("total_ratio", "whole call"))
             if r.get(key) is not None]
    return f" (time: {', '.join(parts)})" if parts else ""


def render() -> str:
    """RESULTS.md's text: the table of every result JSON, then NOTES.md (notes are written there,
    never into RESULTS.md, which this rewrites)."""
    rows = []
    for f in sorted((HERE / "results").glob("*.json")):
        r = json.loads(f.read_text())
        ratio, target = r.get("ratio"), r.get("target")
        met = "" if ratio is None or target is None else ("yes" if ratio >= target else "**no**")
        shown = _fmt(ratio) + _time_ratios(r)
        rows.append(f"| {r['name']} | {shown} | {_fmt(target)} | {met} | {r.get('date', '')[:16]} | "
                    f"{r.get('machine', '')} | `{r.get('command', '')}` |")
    text = ["# Benchmark results", "",
            "Latest numbers of each benchmark in `bench/` (regenerate with `python bench/write_results.py`).",
            "`ratio` is ours / the ceiling or baseline measured in the same run (higher is better; a benchmark",
            "with time ratios shows them beside, e.g. weight_sync_delta's: the pause and the whole call); each",
            "benchmark's JSON in `bench/results/` holds every metric, the trials and the configuration.", "",
            "| benchmark | ratio | target | met | date (UTC) | machine | command |",
            "| --- | --- | --- | --- | --- | --- | --- |", *rows, ""]
    notes = HERE / "NOTES.md"
    if notes.exists():
        text += [notes.read_text()]
    return "\n".join(text)


def main() -> Path:
    out = HERE / "RESULTS.md"
    out.write_text(render())
    return out


if __name__ == "__main__":
    print(main())
