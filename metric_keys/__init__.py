"""The metric keys that the plots draw, and the plots: one declaration for both.

Each key a plot draws is a :class:`Metric` constant here, and the part that logs the value uses
the same constant (``rollout_manager/summary.py``, ``train_backend/losses.py`` and
``train_backend/step.py``, the driver ``scripts/components.py``), so a renamed metric renames
the plot's line with it. ``scripts/metrics_log.py`` draws :data:`PLOTS` from ``metrics.jsonl``;
``tests/test_e2e_train.py`` checks that the main job writes every plot README lists.

Imports nothing of ours (every part uses it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    """One logged value: ``key`` as in ``metrics.jsonl`` (``<part>/<name>``); ``label`` says what
    it measures in a plot's legend."""

    key: str
    label: str = ""

    @property
    def name(self) -> str:
        """The key without its part's prefix: what a part that adds the prefix itself
        (``f"{prefix}/{name}"``) writes."""
        return self.key.split("/", 1)[1]


@dataclass(frozen=True)
class Panel:
    """One axis of a plot: metrics in one unit (``ylabel`` names it)."""

    ylabel: str
    lines: tuple[Metric, ...]


@dataclass(frozen=True)
class Plot:
    """One PNG file; its panels are stacked, sharing the step axis."""

    file: str
    title: str
    panels: tuple[Panel, ...]


# --- rollout_manager/summary.py (the same names under eval/ for evaluations) -----------------------
ROLLOUT_REWARD_MEAN = Metric("rollout/reward_mean", "rollout: mean reward of the step's samples")
ROLLOUT_RESPONSE_LEN_MEAN = Metric("rollout/response_len_mean", "rollout: mean response length")
ROLLOUT_TOKENS_PER_S = Metric("rollout/tokens_per_s", "rollout: generated tokens / rollout wall time")
EVAL_ACCURACY = Metric("eval/accuracy", "eval: mean reward on --eval-prompt-data")

# --- train_backend (losses.py's stats, step.py's step metrics) -------------------------------------
TRAIN_REWARD_MEAN = Metric("train/reward_mean", "train: mean reward of the trained batch")
TRAIN_KL = Metric("train/kl", "train: KL to the reference model (with one)")
TRAIN_PPO_KL = Metric("train/ppo_kl", "train: old policy -> policy (k1)")
TRAIN_ROLLOUT_KL = Metric("train/train_rollout_kl", "train vs rollout log-probs (k3)")
TRAIN_ROLLOUT_LOGP_ABS_DIFF = Metric("train/train_rollout_logp_abs_diff",
                                     "train vs rollout: mean |log p difference|")
TRAIN_TOKENS_PER_S = Metric("train/tokens_per_s", "train: trained tokens / train step wall time")

# --- the driver (scripts/components.py): where each step's wall time went --------------------------
STEP_TIME = Metric("perf/step_time", "whole step")
ROLLOUT_TIME = Metric("perf/rollout_time", "rollout")
TRAIN_TIME = Metric("perf/train_time", "train")
WEIGHT_SYNC_TIME = Metric("perf/weight_sync_time", "weight sync")

#: The plots every run writes at its end (unless --no-plots), one per entry; a panel without
#: data in the run (``train/kl`` without a reference model) is left out, a plot without any is not
#: written (and the run's closing summary says so).
PLOTS: tuple[Plot, ...] = (
    Plot("reward.png", "reward", (Panel("mean reward", (ROLLOUT_REWARD_MEAN, TRAIN_REWARD_MEAN)),)),
    Plot("eval_accuracy.png", "eval accuracy", (Panel("accuracy", (EVAL_ACCURACY,)),)),
    Plot("response_length.png", "response length", (Panel("tokens", (ROLLOUT_RESPONSE_LEN_MEAN,)),)),
    # one panel each: the KL to a reference model is orders of magnitude above the train/rollout
    # mismatch of a healthy run, which would be a flat line on its axis
    Plot("kl.png", "KL", (Panel("KL to reference (nats/token)", (TRAIN_KL,)),
                          Panel("train-rollout KL (nats/token)", (TRAIN_ROLLOUT_KL,)),
                          Panel("|Δ log p| (nats/token)", (TRAIN_ROLLOUT_LOGP_ABS_DIFF,)))),
    Plot("throughput.png", "throughput", (Panel("tokens/s", (ROLLOUT_TOKENS_PER_S, TRAIN_TOKENS_PER_S)),
                                          Panel("seconds per step", (STEP_TIME, ROLLOUT_TIME, TRAIN_TIME,
                                                                     WEIGHT_SYNC_TIME)))),
)
