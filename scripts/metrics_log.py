"""Run output: ``metrics.jsonl`` (one line per step and per eval), TensorBoard, wandb, PNG plots.

Every record carries ``step`` plus namespaced keys (``rollout/reward_mean``, ``train/loss``,
``eval/accuracy``, ``perf/step_time``, ...). Plots are drawn from ``metrics.jsonl`` at the end,
so a resumed run's plots cover the whole run; which plots, and the keys they draw, are declared
once in :mod:`metric_keys` (``PLOTS``), next to the keys the parts log.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from metric_keys import EVAL_ACCURACY, PLOTS, Metric, Panel, Plot

class MetricsLogger:
    """Appends metric records to ``output_dir/metrics.jsonl`` and, if asked, TensorBoard/wandb."""

    def __init__(self, output_dir: str | Path, use_tensorboard: bool = False, use_wandb: bool = False,
                 wandb_project: str | None = None, run_config: dict[str, Any] | None = None,
                 wandb_group: str | None = None, wandb_key: str | None = None):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        if use_tensorboard:
            self._tb = _EventFile(self.dir / "tensorboard")
        self._wandb = None
        if use_wandb:
            try:
                import wandb
            except ImportError:
                raise ValueError("--use-wandb: the wandb package is not installed (pip install wandb)") from None
            if wandb_key:  # slime's --wandb-key: log in with it instead of the stored credentials
                wandb.login(key=wandb_key)
            self._wandb = wandb.init(project=wandb_project or "reservoir", group=wandb_group,
                                     config=run_config or {}, dir=str(self.dir))

    def truncate_after(self, step: int) -> int:
        """Resuming from the checkpoint of ``step``: drop the records of later steps (the resumed
        run logs them again), and have TensorBoard purge its events of those steps. Returns how
        many lines were dropped. A torn last line (the writer was killed mid-write) is dropped too."""
        self._file.flush()
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                keep = json.loads(line)["step"] <= step
            except (ValueError, KeyError, TypeError):
                keep = False
            if keep:
                kept.append(line)
            else:
                dropped += 1
        if dropped:
            self._file.close()
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(f"{line}\n" for line in kept))
            tmp.replace(self.path)  # atomic: a crash now leaves the old file or the new one
            self._file = open(self.path, "a", buffering=1)
        if self._tb is not None:  # TensorBoard hides the earlier session's events of steps > step
            self._tb.close()
            self._tb = _EventFile(self.dir / "tensorboard", purge_step=step + 1)
        return dropped

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: _jsonable(v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        numeric = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            self._tb.add_scalars(step, numeric)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class _EventFile:
    """A TensorBoard event file in ``log_dir``, written as ``torch.utils.tensorboard.SummaryWriter``
    writes it (TensorBoard's own ``EventFileWriter``, events built the same way), without importing
    torch: the launcher's process needs torch for nothing else, and importing it is most of the
    launcher's start-up CPU. ``purge_step``: TensorBoard hides the events of this and later steps
    that an earlier session wrote (a resumed run logs them again)."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(str(log_dir), 10, 120, "")  # SummaryWriter's queue, flush and suffix
        if purge_step is not None:  # the two events SummaryWriter(purge_step=...) starts with
            self._add(Event(file_version="brain.Event:2"), purge_step)
            self._add(Event(session_log=SessionLog(status=SessionLog.START)), purge_step)

    def _add(self, event: Any, step: int) -> None:
        event.wall_time = time.time()
        event.step = int(step)
        self._writer.add_event(event)

    def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """One event holding every scalar (each as ``add_scalar`` writes it; an event per scalar
        cost a protobuf, a queue hand-off and a write each, ~100 a step), flushed."""
        values = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]
        self._add(self._event(summary=self._summary(value=values)), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Draw each plot of ``metric_keys.PLOTS`` that has data in the log; returns the files written.

    Each panel is its own axis (one unit each). A line whose values equal an earlier line's of the
    same panel at every step (train and rollout reward in sync mode) is not drawn over it: the
    earlier line's legend names both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir = Path(out_dir)
    written = []
    for plot, panels in plot_layout(read_metrics(metrics_path)):
        fig, axes = plt.subplots(len(panels), 1, figsize=(6.5, 1.2 + 2.6 * len(panels)), sharex=True, squeeze=False)
        for ax, (panel, lines) in zip(axes[:, 0], panels):
            for label, pts in lines:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if len(pts) < 30 else None, label=label)
            ax.set_ylabel(panel.ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        axes[-1, 0].set_xlabel("step")
        axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
        axes[0, 0].set_title(plot.title)
        fig.tight_layout()
        fig.savefig(out_dir / plot.file, dpi=100)
        plt.close(fig)
        written.append(out_dir / plot.file)
    return written


def plot_layout(records: list[dict[str, Any]]) -> list[tuple[Plot, list[tuple[Panel, list[tuple[str, list]]]]]]:
    """What :func:`plot_metrics` draws from ``records``: per plot with data, its panels with data,
    each with its lines as ``(legend label, [(step, value)])``."""
    out = []
    for plot in PLOTS:
        panels = [(panel, lines) for panel in plot.panels if (lines := _panel_lines(panel.lines, records))]
        if panels:
            out.append((plot, panels))
    return out


def missing_plots(written: list[Path]) -> list[Plot]:
    """The declared plots not among ``written`` (no data for them in this run)."""
    names = {p.name for p in written}
    return [plot for plot in PLOTS if plot.file not in names]


def _panel_lines(metrics: tuple[Metric, ...], records: list[dict[str, Any]]) -> list[tuple[str, list]]:
    """``(legend label, [(step, value)])`` per metric with data; a metric equal to an earlier one
    at every step joins that one's label instead of being drawn on top of it."""
    lines: list[tuple[list[str], list]] = []
    for m in metrics:
        pts = [(r["step"], r[m.key]) for r in records
               if isinstance(r.get(m.key), (int, float)) and not isinstance(r.get(m.key), bool)]
        if not pts:
            continue
        same = next((names for names, other in lines if _coincide(pts, other)), None)
        if same is not None:
            same.append(m.key)
        else:
            lines.append(([m.key, m.label], pts))
    return [(_label(names), pts) for names, pts in lines]


def _label(names: list[str]) -> str:
    key, label, *same = names
    text = f"{key} ({label})" if label else key
    return text + "".join(f"\n= {k} (the same values)" for k in same)


def _coincide(a: list, b: list) -> bool:
    return len(a) == len(b) and all(sa == sb and math.isclose(va, vb, rel_tol=1e-9, abs_tol=1e-12)
                                    for (sa, va), (sb, vb) in zip(a, b))


def eval_line(records: list[dict[str, Any]], key: str = EVAL_ACCURACY.key) -> str | None:
    """``key`` at the run's first, best and last evaluation, for its closing summary (None: no evaluation)."""
    evals = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    if not evals:
        return None
    (first_step, first), (last_step, last) = evals[0], evals[-1]
    best_step, best = max(evals, key=lambda e: e[1])  # the earliest of equal bests
    return (f"{key}: first {first:.3g} (step {first_step}), best {best:.3g} (step {best_step}), "
            f"last {last:.3g} (step {last_step})")


def duration(seconds: float) -> str:
    """``83`` -> ``"1m23s"`` (``"42.0s"`` under a minute)."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
