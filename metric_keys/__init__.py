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
EVAL_ACCURACY = Metric("eval/accuracy", "eval: fraction right on --eval-prompt-data (metadata correct, else reward)")

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

# --- inside those parts (issue 30's accounting of a step): each part's own time, by phase. What a
# driver-side time above spends outside its part (the Ray call, pickling, the actor's queue) is
# that time minus the part's own: ``step_breakdown`` derives it ------------------------------------
# rollout_manager/manager.py (push): the whole push in the manager, and its two buffer calls
ROLLOUT_PUSH_TIME = Metric("perf/rollout_push_time", "rollout: the manager's push (generate + buffer calls)")
ROLLOUT_BUFFER_CALLS_TIME = Metric("perf/rollout_buffer_calls_time",
                                   "rollout: the manager's buffer calls (take_returned, put)")
# train_backend/step.py (run_train_step, rank 0): the phases add up to train/step_time_s
TRAIN_BATCHING_TIME = Metric("perf/train_batching_time", "train: batch, advantages, micro-batch packing")
TRAIN_LOG_PROB_TIME = Metric("perf/train_log_prob_time", "train: old/reference log-prob forwards")
TRAIN_FORWARD_BACKWARD_TIME = Metric("perf/train_forward_backward_time", "train: forward + loss + backward")
TRAIN_OPTIMIZER_TIME = Metric("perf/train_optimizer_time", "train: zero_grad, clip, optimizer + lr step")
TRAIN_STATS_TIME = Metric("perf/train_stats_time", "train: the step's stats summed (over ranks)")
# train_backend/actor_group.py (TrainerRank.push_weights, rank 0): gathering the weights, then the
# sender's push (weight_sync/total_s: its HTTP round trips and transfer), then recording the version
WEIGHT_GATHER_TIME = Metric("perf/weight_gather_time", "weight sync: gathering the full weights")
WEIGHT_PUSH_RANK_TIME = Metric("perf/weight_push_rank_time", "weight sync: the rank's whole push")
WEIGHT_VERSION_RECORD_TIME = Metric("perf/weight_version_record_time",
                                    "weight sync: recording the version in the buffer (a Ray call)")
# derived by step_breakdown: the driver's calls minus the parts' own time
ROLLOUT_CALL_TIME = Metric("perf/rollout_call_time", "rollout: the driver's Ray call around the push")
TRAIN_CALL_TIME = Metric("perf/train_call_time", "train: the driver's Ray call (batch put, call, reply)")
WEIGHT_SYNC_CALL_TIME = Metric("perf/weight_sync_call_time", "weight sync: the driver's Ray call around the push")
ROLLOUT_MANAGER_REST_TIME = Metric("perf/rollout_manager_rest_time",
                                   "rollout: the push's time outside generation and buffer calls (metrics)")

_OUTSIDE = ((ROLLOUT_CALL_TIME, ROLLOUT_TIME, ROLLOUT_PUSH_TIME),
            (TRAIN_CALL_TIME, TRAIN_TIME, Metric("train/step_time_s")),
            (WEIGHT_SYNC_CALL_TIME, WEIGHT_SYNC_TIME, WEIGHT_PUSH_RANK_TIME))


def step_breakdown(step: dict[str, float]) -> dict[str, float]:
    """The derived parts of a step's record (the driver's ``perf/...`` times and the parts' own):
    each driver call's time outside its part, and the rollout push's time outside generation and
    its buffer calls. Only those whose inputs are in ``step`` (async mode has no rollout call)."""
    out = {}
    for derived, outer, inner in _OUTSIDE:
        if outer.key in step and inner.key in step:
            out[derived.key] = step[outer.key] - step[inner.key]
    if all(k in step for k in (ROLLOUT_PUSH_TIME.key, ROLLOUT_BUFFER_CALLS_TIME.key, "rollout/time_s")):
        out[ROLLOUT_MANAGER_REST_TIME.key] = (step[ROLLOUT_PUSH_TIME.key] - step[ROLLOUT_BUFFER_CALLS_TIME.key]
                                              - step["rollout/time_s"])
    return out


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
