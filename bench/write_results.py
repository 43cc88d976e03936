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


def render() -> str:
    """RESULTS.md's text: the table of every result JSON, then NOTES.md (notes are written there,
    never into RESULTS.md, which this rewrites)."""
    rows = []
    for f in sorted((HERE / "results").glob("*.json")):
        r = json.loads(f.read_text())
        ratio, target = r.get("ratio"), r.get("target")
        met = "" if ratio is None or target is None else ("yes" if ratio >= target else "**no**")
        shown = _fmt(ratio) + (f" (time {_fmt(r['time_ratio'])})" if r.get("time_ratio") is not None else "")
        rows.append(f"| {r['name']} | {shown} | {_fmt(target)} | {met} | {r.get('date', '')[:16]} | "
                    f"{r.get('machine', '')} | `{r.get('command', '')}` |")
    text = ["# Benchmark results", "",
            "Latest numbers of each benchmark in `bench/` (regenerate with `python bench/write_results.py`).",
            "`ratio` is ours / the ceiling or baseline measured in the same run (higher is better; a benchmark",
            "with a second ratio shows it beside, e.g. weight_sync_delta's time ratio); each",
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
