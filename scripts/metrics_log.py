"""Run output: ``metrics.jsonl`` (one line per step and per eval), TensorBoard, wandb, PNG plots.

Every record carries ``step`` plus namespaced keys (``rollout/reward_mean``, ``train/loss``,
``eval/accuracy``, ``perf/step_time``, ...). Plots are drawn from ``metrics.jsonl`` at the end,
so a resumed run's plots cover the whole run.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

PLOTS = {  # file name -> metric keys drawn on it (the first key that exists is plotted per line)
    "reward.png": ["rollout/reward_mean", "train/reward_mean"],
    "eval_accuracy.png": ["eval/accuracy"],
    "response_length.png": ["rollout/response_len_mean"],
    "kl.png": ["train/kl", "train/train_rollout_logprob_abs_diff"],
    "throughput.png": ["perf/tokens_per_s", "rollout/tokens_per_s", "perf/step_time"],
}


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
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"))
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
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"), purge_step=step + 1)
        return dropped

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: _jsonable(v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        numeric = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


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
    """Draw one PNG per entry of ``PLOTS`` whose keys appear in the log; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    out_dir = Path(out_dir)
    written = []
    for name, keys in PLOTS.items():
        series = {k: [(r["step"], r[k]) for r in records if isinstance(r.get(k), (int, float))] for k in keys}
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k, pts in series.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if len(pts) < 30 else None, label=k)
        ax.set_xlabel("step")
        ax.set_title(name.removesuffix(".png").replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(out_dir / name)
    return written
