"""The agent loop's record of an episode (``rollout_manager/agent.py``), kept in the sample's metadata
(so the buffer, Parquet files and the trainer's hooks see it): the turn log and the loop's state.
It lives with the ``Sample`` because both the rollout manager (which writes it) and the trainer
(whose advantage hooks read it) stand on this package.

``sample.metadata["agent_turns"]``: one dict per turn, in order::

    {"kind": "model" | "env", "start": int, "end": int, "weight_versions": [int, ...],
     "reward": float | None, "open": bool}

``start``/``end`` index ``sample.tokens`` (the prompt included, as the ``--tito-check`` records
do). A model turn spans the engine's output ids (loss mask 1, the engine's log-probs); an env turn
spans what the environment added (tool results, user turns, the chat template's glue and the next
generation prompt: loss mask 0, log-prob 0.0). ``weight_versions``: the policy versions that
generated a model turn (two when a weight update paused it midway); empty for env turns. ``reward``:
what the environment's ``step`` returned for the model turn's reply (None for env turns). ``open``:
a model turn interrupted before its end (a partial rollout resumes it).

``sample.metadata["agent"]``: the loop's state (``messages`` so far, ``tools``, ``env_tokens``,
``end_reason``, per-call tool times and errors, loop-lag samples, and ``env``: a dict an
environment may keep its own JSON-able per-episode state in). ``reset_sample`` drops both keys:
an episode restarted from its prompt starts afresh.

``turns_for_training`` turns the log into what the advantage hooks get (spans relative to the
response, so ``t["start"]:t["end"]`` index the per-token tensors).
"""

from __future__ import annotations

from typing import Any

__all__ = ["AGENT_TURNS", "AGENT_STATE", "END_REASONS", "turn_log", "open_turn", "close_turn", "add_turn",
           "turn_masks", "turns_for_training", "agent_metrics"]

AGENT_TURNS, AGENT_STATE = "agent_turns", "agent"
#: Why an episode ended: the environment said done; --agent-max-turns; --agent-max-env-tokens; the
#: response budget (--rollout-max-response-len) ran out.
END_REASONS = ("done", "max_turns", "env_tokens", "length")


def turn_log(sample: Any) -> list[dict]:
    """The sample's turn log (a list in its metadata, created empty when missing)."""
    return sample.metadata.setdefault(AGENT_TURNS, [])


def open_turn(sample: Any, kind: str) -> dict:
    """Start a turn at the end of ``sample.tokens``; ``close_turn`` sets its end."""
    turn = {"kind": kind, "start": len(sample.tokens), "end": len(sample.tokens), "weight_versions": [],
            "reward": None, "open": True}
    turn_log(sample).append(turn)
    return turn


def close_turn(sample: Any, turn: dict, still_open: bool = False) -> None:
    """Set ``turn``'s end to the end of ``sample.tokens`` (``still_open``: it was interrupted)."""
    turn["end"] = len(sample.tokens)
    turn["open"] = still_open


def add_turn(sample: Any, kind: str, ids: list[int], logp: float = 0.0) -> dict:
    """Append ``ids`` as a turn that is not the model's (loss mask 0, log-prob ``logp``) and log it."""
    turn = open_turn(sample, kind)
    sample.tokens += ids
    sample.response_length += len(ids)
    sample.loss_mask = (sample.loss_mask or []) + [0] * len(ids)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + [logp] * len(ids)
    close_turn(sample, turn)
    return turn


def turn_masks(sample: Any) -> list[int]:
    """The loss mask the turn log implies: 1 on model turns, 0 on env turns (response positions)."""
    prompt = sample.prompt_length
    mask = [0] * sample.response_length
    for t in sample.metadata.get(AGENT_TURNS) or []:
        if t["kind"] == "model":
            mask[t["start"] - prompt:t["end"] - prompt] = [1] * (t["end"] - t["start"])
    return mask


def turns_for_training(sample: Any) -> list[dict]:
    """The turn log with ``start``/``end`` relative to the response (what the advantage hooks get as
    ``rollout_data["turns"]``); empty for a sample of no agent episode."""
    prompt = sample.prompt_length
    return [{**t, "start": t["start"] - prompt, "end": t["end"] - prompt}
            for t in sample.metadata.get(AGENT_TURNS) or []]


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] if ordered else 0.0


def agent_metrics(samples: list[Any]) -> dict[str, float]:
    """The agent loop's metrics over ``samples`` (``agent/...``, without the ``rollout/`` prefix);
    empty when none ran an episode: ``episodes``, ``turns_mean`` (model turns per episode),
    ``tool_calls`` and ``tool_errors`` (sums), ``tool_time_p95_s`` (one value per tool call),
    ``loop_lag_p95_s`` / ``loop_lag_max_s`` (how late the event loop woke while environment steps
    ran), ``env_tokens_mean``, and ``end/<reason>`` (episodes by how they ended, ``END_REASONS``;
    ``unfinished`` for one interrupted or failed)."""
    states = [(s, s.metadata[AGENT_STATE]) for s in samples if isinstance(s.metadata.get(AGENT_STATE), dict)]
    if not states:
        return {}
    tool_times = [t for _, st in states for t in st.get("tool_time_s", [])]
    lags = [x for _, st in states for x in st.get("loop_lag_s", [])]
    turns = [sum(t["kind"] == "model" for t in s.metadata.get(AGENT_TURNS) or []) for s, _ in states]
    m = {"agent/episodes": float(len(states)), "agent/turns_mean": sum(turns) / len(turns),
         "agent/tool_calls": float(sum(st.get("tool_calls", 0) for _, st in states)),
         "agent/tool_errors": float(sum(st.get("tool_errors", 0) for _, st in states)),
         "agent/tool_time_p95_s": _p95(tool_times), "agent/loop_lag_p95_s": _p95(lags),
         "agent/loop_lag_max_s": max(lags, default=0.0),
         "agent/env_tokens_mean": sum(st.get("env_tokens", 0) for _, st in states) / len(states)}
    for _, st in states:
        key = f"agent/end/{st.get('end_reason') or 'unfinished'}"
        m[key] = m.get(key, 0.0) + 1
    return m
