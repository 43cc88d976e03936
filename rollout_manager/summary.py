"""Rollout metrics (``rollout/...`` or ``eval/...`` keys) and the human-readable summary."""

from __future__ import annotations

import statistics
from collections import Counter

from typing import Any

from buffer.sample import CORRECT, Sample, Status
from metric_keys import EVAL_ACCURACY, ROLLOUT_RESPONSE_LEN_MEAN, ROLLOUT_REWARD_MEAN, ROLLOUT_TOKENS_PER_S
from buffer.agent_turns import agent_metrics
from rollout_manager.plugin_api import RolloutStats


def _value(reward: Any, key: str | None) -> float | None:
    """A reward as a float (``reward[key]`` for dicts); None when it cannot be read that way."""
    if isinstance(reward, dict):
        reward = reward.get(key) if key is not None else None
    if isinstance(reward, (int, float)):
        return float(reward)
    return None


def rollout_metrics(groups: list[list[Sample]], stats: RolloutStats | None, seconds: float,
                    prefix: str = "rollout", reward_key: str | None = None) -> dict[str, float]:
    """Metrics of one step: rewards, pass rates, lengths, truncation, throughput, failures.

    ``reward_mean/std`` over scored samples (failed ones have no reward); ``pass_rate``: fraction
    of scored samples with reward > 0; ``pass_at_k``: fraction of groups with at least one such
    sample; ``response_len_*`` in tokens; ``truncated_frac``: samples that hit the length limit;
    ``tokens_per_s``: generated tokens over the step's wall time; ``failures/<reason>``: failed
    samples by reason (``engine: ...``, ``reward: <exception>``, ``generate: <exception>``);
    ``agent/...``: the agent loop's (``buffer.agent_turns.agent_metrics``) when samples ran episodes.
    ``accuracy`` (``eval/accuracy``; under ``rollout/`` only when a plugin marked a sample): the mean of
    ``Sample.correctness`` over scored samples, the fraction whose final answer is right where
    ``metadata["correct"]`` says so, the reward elsewhere (so a shaped reward is not read as accuracy).
    """
    samples = [s for g in groups for s in g]
    scored = [s.scalar_reward(reward_key) for s in samples if s.reward is not None]
    lengths = [s.response_length for s in samples]
    failures = Counter(s.metadata.get("failure_reason", "unknown") for s in samples if s.status == Status.FAILED)
    if stats is not None:
        failures.update(stats.failures)
    # a custom generate's or rollout function's tokens are not counted by the default generate
    generated = stats.generated_tokens if stats is not None and stats.generated_tokens else sum(lengths)
    m: dict[str, float] = {
        "num_groups": len(groups),
        "num_samples": len(samples),
        ROLLOUT_REWARD_MEAN.name: statistics.fmean(scored) if scored else float("nan"),
        "reward_std": statistics.pstdev(scored) if len(scored) > 1 else 0.0,
        "pass_rate": sum(r > 0 for r in scored) / len(scored) if scored else float("nan"),
        "pass_at_k": (sum(any((_value(s.reward, reward_key) or 0) > 0 for s in g) for g in groups)
                      / len(groups)) if groups else float("nan"),
        ROLLOUT_RESPONSE_LEN_MEAN.name: statistics.fmean(lengths) if lengths else 0.0,
        "response_len_max": max(lengths, default=0),
        "response_len_min": min(lengths, default=0),
        "truncated_frac": sum(s.status == Status.TRUNCATED for s in samples) / len(samples) if samples else 0.0,
        "failed_frac": sum(s.status == Status.FAILED for s in samples) / len(samples) if samples else 0.0,
        ROLLOUT_TOKENS_PER_S.name: generated / seconds if seconds > 0 else 0.0,
        "time_s": seconds,
    }
    versions = [v for s in samples for v in s.weight_versions]
    if versions:
        m["weight_version_min"], m["weight_version_max"] = min(versions), max(versions)
    if stats is not None:
        m.update(requests=stats.requests, retries=stats.retries, aborted_requests=stats.aborted_requests,
                 dropped_groups=stats.dropped_groups, returned_groups=stats.returned_groups,
                 failed_groups=stats.failed_groups)
        m.update(_request_split(stats.request_times))
        for reason, n in sorted(stats.drop_reasons.items()):
            m[f"dynamic_filter/drop_{reason}"] = n
        for kind, n in sorted(stats.tito.items()):  # --tito-check: samples checked, and by finding
            m[f"tito/{kind}"] = n
    for reason, n in sorted(failures.items()):
        m[f"failures/{reason}"] = n
    if prefix == "eval" or any(CORRECT in s.metadata for s in samples):
        right = [s.correctness(reward_key) for s in samples if s.reward is not None]
        m[EVAL_ACCURACY.name] = statistics.fmean(right) if right else float("nan")
    m.update(agent_metrics(samples))  # --agent-env episodes: turns, tool calls and errors, loop lag
    return {f"{prefix}/{k}": float(v) for k, v in m.items()}


def _request_split(times: list[tuple[float, float | None]]) -> dict[str, float]:
    """The medians over the step's answered requests: ``request_time_s`` (as the manager saw each),
    ``engine_time_s`` (as the engine reports it, SGLang's ``e2e_latency``) and
    ``request_outside_engine_s`` (each request's difference: HTTP, the router, (de)serialization)."""
    if not times:
        return {}
    out = {"request_time_s": statistics.median(t for t, _ in times)}
    paired = [(t, e) for t, e in times if e is not None]
    if paired:
        out["engine_time_s"] = statistics.median(e for _, e in paired)
        out["request_outside_engine_s"] = statistics.median(t - e for t, e in paired)
    return out


def eval_data_metrics(data: dict[str, dict[str, Any]], reward_key: str | None = None) -> dict[str, float]:
    """Metrics of slime's evaluation data (``RolloutFnEvalOutput.data``: dataset name ->
    ``{"rewards", "truncated", "samples"}``): ``eval/<name>`` (mean reward, failed samples left out),
    ``eval/<name>-truncated_ratio``, ``eval/reward_mean`` over all datasets, and ``eval/accuracy``:
    the same mean, with a sample's ``Sample.correctness`` in place of its reward where its
    ``metadata["correct"]`` marks it (``samples`` given, one per reward)."""
    out: dict[str, float] = {}
    everything: list[float] = []
    right: list[float] = []
    for name, entry in data.items():
        values = [_value(r, reward_key) for r in entry.get("rewards", [])]
        rewards = [v for v in values if v is not None]
        everything += rewards
        samples = entry.get("samples") or []
        marked = samples if len(samples) == len(values) else [None] * len(values)
        right += [s.correctness(reward_key) if isinstance(s, Sample) and CORRECT in s.metadata else v
                  for s, v in zip(marked, values) if v is not None]
        out[f"eval/{name}"] = statistics.fmean(rewards) if rewards else float("nan")
        truncated = entry.get("truncated")
        if truncated:
            out[f"eval/{name}-truncated_ratio"] = sum(map(bool, truncated)) / len(truncated)
        failed = sum(isinstance(s, Sample) and s.status == Status.FAILED for s in samples)
        if failed:
            out[f"eval/{name}-failed_samples"] = float(failed)
    out["eval/num_samples"] = float(len(everything))
    out[f"eval/{ROLLOUT_REWARD_MEAN.name}"] = statistics.fmean(everything) if everything else float("nan")
    out[EVAL_ACCURACY.key] = statistics.fmean(right) if right else float("nan")
    return out


def format_summary(metrics: dict[str, float], title: str = "rollout summary") -> str:
    """A short table of the metrics for the terminal."""
    width = max(len(k) for k in metrics) if metrics else 10
    lines = [title, "-" * (width + 16)]
    for k, v in metrics.items():
        lines.append(f"{k:<{width}}  {v:>12.4g}")
    return "\n".join(lines)


def merge_metrics(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Average metrics over steps (counters summed)."""
    if not per_step:
        return {}
    summed = ("num_groups", "num_samples", "requests", "retries", "aborted_requests", "dropped_groups",
              "returned_groups", "failed_groups", "time_s", "failures/", "dynamic_filter/", "tito/",
              "agent/episodes", "agent/tool_calls", "agent/tool_errors", "agent/end/")
    keys = sorted({k for m in per_step for k in m})
    out = {}
    for k in keys:
        vals = [m[k] for m in per_step if k in m]
        out[k] = sum(vals) if any(s in k for s in summed) else statistics.fmean(vals)
    return out
