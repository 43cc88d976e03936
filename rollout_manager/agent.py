"""The agent loop: multi-turn episodes between the model and an environment, as a custom generate.

``--agent-env pkg.mod.make_env`` names an environment factory (loaded like every plugin, by import
path; called once as ``make_env(args)``; a class works). The environment has two methods (and an
optional third), each a plain or an async function (plain ones run in a plugin thread, never on the
event loop)::

    start(sample) -> (messages, tools)
        The episode's opening messages (system, user: rendered with the chat template, ``tools``
        given to it, as the prompt's ids) and the tool schemas; ``(None, tools)`` keeps the
        sample's own prompt ids (its messages: ``sample.prompt`` as a list; for a prompt given as
        text, ``chat_append.PROMPT_STANDIN``, after which an append-stable template writes the
        same turns). With ``--apply-chat-template`` ``sample.prompt`` is the templated text: an
        environment that renders the prompt itself (the built-in one) wants it off.
    step(sample, reply) -> (messages, done, reward) or (messages, done, reward, info)
        ``reply``: the model's turn as text (without the template's close). ``messages``: what
        follows it (tool results, a user turn), appended as one group; ``done``: the episode is
        over; ``reward``: a float for this reply, or None. ``info`` (optional): ``{"tool_calls":
        int, "tool_errors": int, "tool_time_s": [float]}`` for the metrics (default: one call per
        ``tool`` message, no errors, the step's time), and ``"correct": bool``, whether the episode's
        answer is right so far: the loop keeps the last one given as ``sample.metadata["correct"]``
        (``buffer.sample.CORRECT``), which ``eval/accuracy`` (and ``rollout/accuracy``) count in
        place of the reward. An environment whose reward gives partial credit (a shaped reward)
        marks every step (``False`` until a right final answer), so accuracy stays the fraction of
        right final answers; where nothing marks a sample, its reward counts, as before.

    continue_turn(sample, reply) -> bool (optional)
        Called when a model turn ended on a stop string (``--rollout-stop``; the model did not emit
        the template's close) before ``step``: True generates on in the same turn (another request
        from its tokens so far; the stop strings apply to the new text only), so a stop string may
        also fire where the turn is not over (the built-in environment's, at an opening code fence).
        Never consulted for a template without a close (a stop cannot be told from the end there).

Per-episode state an environment needs goes in ``sample.metadata["agent"]["env"]`` (a dict, kept
with the sample, cleared when the episode restarts). The built-in ``plugins.python_env.make_env``
runs the model's Python code in ``plugins.python_sandbox``.

Setting ``--agent-env`` makes this module's ``generate`` the run's ``--custom-generate-function-path``
(unless one is given: a custom generate may call this one). Each model turn is one call of the
default ``generate`` (token in, token out; retries, pauses, ``--partial-rollout``,
``--mask-offpolicy-in-partial-rollout`` and the ``--tito-check`` records all apply); each env turn's
ids come from ``plugins.chat_append.append_ids`` (the chat template's render of the new messages
after the conversation so far, never a re-tokenized history), with loss mask 0 and log-prob 0.0.
The turn log (``buffer/agent_turns.py``) records each turn's span, kind, weight versions and
reward in ``sample.metadata``.

The environment steps after every model turn, the last one included (its reward counts; a tool it
calls then runs, counted, though the model never sees the result). An episode ends when the
environment says done, after ``--agent-max-turns`` model turns, when an
env turn would pass ``--agent-max-env-tokens`` or the response budget (``--rollout-max-response-len``,
which counts env tokens too): the reason is kept (``metadata["agent"]["end_reason"]``) and counted
(``rollout/agent/end/<reason>``). The sample's reward is the sum of the turn rewards the environment
gave; when it gave none, the run's reward (``--rm-type`` / ``--custom-rm-path``) scores the sample.

Interrupted mid-turn (a weight update's pause, or the step winding down), the sample keeps its
turns: with ``--partial-rollout`` the open model turn resumes from its tokens so far, earlier turns
untouched; without it the default generate restarts the sample from its prompt, and the episode
starts afresh (``start`` is called again).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from typing import Any

from buffer.sample import CORRECT, Sample, Status
from plugins.chat_append import (PROMPT_STANDIN, ChatAppendError, append_ids, check_append_stable, close_remainder,
                                 render_ids, template_close)
from plugins.loader import load_function
from buffer.agent_turns import AGENT_STATE, AGENT_TURNS, add_turn, close_turn, open_turn, turn_log
from rollout_manager.generate import generate as model_turn
from rollout_manager.plugin_api import current_context
from rollout_manager.plugin_calls import call_plugin
from rollout_manager.tito import log_chat_turn

__all__ = ["load_agent_env", "check_agent_template", "generate"]

_FLAG = "--agent-env"
_LAG_TICK_S = 0.02  # how often the loop-lag probe wakes while an environment step runs


def load_agent_env(path: str, args: argparse.Namespace) -> Any:
    """Build the environment ``--agent-env`` names (``factory(args)``); ``ValueError`` naming the flag
    and the path, in one line, when it cannot be imported, built, or lacks ``start``/``step``."""
    factory = load_function(path, _FLAG, params=["args"])
    try:
        env = factory(args)
    except Exception as e:  # the user's factory failing is a start-up error naming the flag
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"{_FLAG} {path!r}: building the environment with (args) failed: "
                         f"{type(e).__name__}: {first}") from e
    for method in ("start", "step"):
        if not callable(getattr(env, method, None)):
            raise ValueError(f"{_FLAG} {path!r}: the environment has no {method}() method")
    return env


def check_agent_template(tokenizer: Any, path: str) -> None:
    """Refuse, at start-up, a chat template the loop cannot append env turns to
    (``plugins.chat_append.check_append_stable``): ``ValueError`` naming the flag and the template."""
    try:
        check_append_stable(tokenizer)
    except ChatAppendError as e:
        raise ValueError(f"{_FLAG} {path!r}: {e}") from e


async def _call_env(method: Any, *args: Any) -> Any:
    ctx = current_context()
    return await call_plugin(method, *args, timeout=ctx.settings.plugins.custom_generate_timeout,
                             what=f"{_FLAG} {ctx.paths.get(_FLAG, '?')} {getattr(method, '__name__', 'method')}()")


@functools.lru_cache(maxsize=8)
def _close_ids(tokenizer: Any) -> tuple[int, ...]:
    return tuple(template_close(tokenizer))


async def _start(ctx: Any, env: Any, sample: Sample, render_prompt: bool) -> dict:
    """A fresh episode: the environment's opening messages (rendered as the prompt when
    ``render_prompt``; otherwise the prompt ids held are kept) and the loop's state."""
    messages, tools = await _call_env(env.start, sample)
    if messages:
        messages = [dict(m) for m in messages]
        if render_prompt:
            sample.tokens = await asyncio.to_thread(render_ids, ctx.tokenizer, messages, add_generation_prompt=True,
                                                    tools=tools)
            sample.response_length = 0
    else:  # a prompt given as text may be templated already: what follows it renders after a stand-in
        prompt = sample.prompt
        messages = [dict(m) for m in prompt] if isinstance(prompt, list) else [dict(m) for m in PROMPT_STANDIN]
    state = {"messages": messages, "tools": tools, "env_tokens": 0, "end_reason": None, "tool_calls": 0,
             "tool_errors": 0, "tool_time_s": [], "loop_lag_s": [], "env": {}}
    sample.metadata[AGENT_STATE] = state
    sample.metadata[AGENT_TURNS] = []
    sample.metadata.pop(CORRECT, None)  # an earlier try's answer says nothing of this episode's
    return state


async def _step_env(env: Any, sample: Sample, reply: str, state: dict) -> tuple[list[dict], bool, float | None]:
    """``env.step``, with the loop's lag measured while it runs and its tool metrics kept."""
    loop = asyncio.get_running_loop()
    worst = [0.0]

    async def probe() -> None:  # how late the loop wakes us: a blocking tool shows here
        while True:
            t = loop.time()
            await asyncio.sleep(_LAG_TICK_S)
            worst[0] = max(worst[0], loop.time() - t - _LAG_TICK_S)

    ticker = asyncio.ensure_future(probe())
    t0 = time.perf_counter()
    try:
        out = await _call_env(env.step, sample, reply)
    finally:
        ticker.cancel()
    took = time.perf_counter() - t0
    if not isinstance(out, (tuple, list)) or len(out) not in (3, 4):
        raise TypeError(f"{_FLAG} step() returned {type(out).__name__}, expected (messages, done, reward[, info])")
    messages, done, reward = out[0] or [], bool(out[1]), out[2]
    info = out[3] if len(out) == 4 and isinstance(out[3], dict) else {}
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise TypeError(f"{_FLAG} step() returned reward {reward!r}, expected a number or None")
    if "correct" in info:
        if not isinstance(info["correct"], bool):
            raise TypeError(f"{_FLAG} step() returned info['correct'] {info['correct']!r}, expected a bool")
        sample.metadata[CORRECT] = info["correct"]
    calls = info.get("tool_calls", sum(m.get("role") == "tool" for m in messages))
    state["tool_calls"] += int(calls)
    state["tool_errors"] += int(info.get("tool_errors", 0))
    state["tool_time_s"] += [float(x) for x in info.get("tool_time_s", [took] if calls else [])]
    state["loop_lag_s"].append(worst[0])
    return [dict(m) for m in messages], done, None if reward is None else float(reward)


async def _continues(env: Any, sample: Sample, reply: str) -> bool:
    """Whether a model turn that ended without the template's close (a stop string, ``--rollout-stop``,
    fired) goes on: the environment's optional ``continue_turn(sample, reply)`` says so."""
    hook = getattr(env, "continue_turn", None)
    return hook is not None and bool(await _call_env(hook, sample, reply))


def _finish(sample: Sample, state: dict, reason: str, status: Status) -> Sample:
    state["end_reason"] = reason
    sample.status = status
    rewards = [t["reward"] for t in turn_log(sample) if t["reward"] is not None]
    if rewards:
        sample.reward = float(sum(rewards))
    return sample


async def generate(args: argparse.Namespace, sample: Sample, sampling_params: dict) -> Sample:
    """Run (or resume) one ``--agent-env`` episode for ``sample`` (slime's custom-generate
    signature; see the module doc)."""
    ctx = current_context()
    env = getattr(ctx, "agent_env", None)
    if env is None:
        raise RuntimeError(f"rollout_manager.agent.generate runs the environment of {_FLAG}, which was not given")
    p, tok = ctx.settings.plugins, ctx.tokenizer
    budget = sampling_params["max_new_tokens"]
    state = sample.metadata.get(AGENT_STATE)
    if state is None:
        if sample.response_length:  # generated by something else: the episode starts from the prompt
            sample.tokens, sample.response_length = sample.tokens[:sample.prompt_length], 0
            sample.loss_mask, sample.rollout_log_probs, sample.response = [], [], ""
        state = await _start(ctx, env, sample, render_prompt=True)
    while True:
        turns = turn_log(sample)
        turn = turns[-1] if turns and turns[-1]["kind"] == "model" and turns[-1]["open"] else None
        if turn is None:
            turn = open_turn(sample, "model")
        versions = len(sample.weight_versions)
        sample.status = Status.PENDING
        await model_turn(args, sample, sampling_params)
        if AGENT_STATE not in sample.metadata:  # the default generate restarted the sample (no partial rollout)
            state = await _start(ctx, env, sample, render_prompt=False)
            turn = open_turn(sample, "model")
            turn["start"], versions = sample.prompt_length, 0
        for v in sample.weight_versions[versions:]:
            if not turn["weight_versions"] or turn["weight_versions"][-1] != v:
                turn["weight_versions"].append(v)
        close_turn(sample, turn, still_open=sample.status == Status.ABORTED)
        if sample.status in (Status.ABORTED, Status.FAILED):
            return sample  # resumed later (partial rollout) or counted as failed
        if sample.status == Status.TRUNCATED:
            return _finish(sample, state, "length", Status.TRUNCATED)
        ids = sample.tokens[turn["start"]:turn["end"]]
        close = list(_close_ids(tok))
        k = len(close) - len(close_remainder(ids, close))  # the close the model emitted, left out of the reply
        reply = tok.decode(ids[:len(ids) - k])
        if close and not k and await _continues(env, sample, reply):
            turn["open"] = True  # a stop string fired where the turn is not over: generate on in it
            continue
        state["messages"].append({"role": "assistant", "content": reply})
        messages, done, reward = await _step_env(env, sample, reply, state)
        turn["reward"] = reward
        if done:
            return _finish(sample, state, "done", Status.COMPLETED)
        if sum(t["kind"] == "model" for t in turn_log(sample)) >= p.agent_max_turns:
            return _finish(sample, state, "max_turns", Status.COMPLETED)
        if not messages:
            raise ValueError(f"{_FLAG} step() returned no messages and done=False: nothing for the model to answer")
        new = await asyncio.to_thread(append_ids, tok, state["messages"], messages, ids=sample.tokens,
                                      tools=state["tools"])
        if p.agent_max_env_tokens is not None and state["env_tokens"] + len(new) > p.agent_max_env_tokens:
            return _finish(sample, state, "env_tokens", Status.COMPLETED)
        if sample.response_length + len(new) >= budget:  # no room left for the model's next turn
            return _finish(sample, state, "length", Status.TRUNCATED)
        add_turn(sample, "env", new)
        log_chat_turn(sample, len(sample.tokens) - len(new), messages)  # for --tito-check's soft checks
        sample.response += tok.decode(new)
        state["messages"] += messages
        state["env_tokens"] += len(new)
