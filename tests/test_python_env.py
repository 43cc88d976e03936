"""The built-in agent environment (plugins/python_env.py): code found in a reply runs in the sandbox,
its answer comes back as a tool message; a reply without code ends the episode. Then a whole
episode through the agent loop, with the instant engine calling the tool every turn."""

from __future__ import annotations

import asyncio

import pytest
from _fixtures_rollout import running_manager, toy_argv
from transformers import AutoTokenizer

from buffer.sample import Sample, Status
from plugins.python_env import (CODE_BLOCK_STOP, PYTHON_TOOL, TOOL_ANSWER_REWARD, PythonToolEnv, as_cell,
                                extract_code, make_env, make_number_answer_env, make_number_answer_user_env,
                                make_shaped_user_env)
from buffer.agent_turns import AGENT_STATE, AGENT_TURNS, turn_masks


def test_extract_code_and_cell():
    assert extract_code("let me see\n```python\nx = 6\nprint(x * 7)\n```\ndone") == "x = 6\nprint(x * 7)\n"
    assert extract_code("<code>1+1</code> then <code>37*48</code>") == "37*48"
    assert extract_code("The answer is 1776.") is None
    assert extract_code("```python3\nprint(2)\n```") == "print(2)\n"  # SmolLM2 writes python3 at times
    assert as_cell("y = 1") == "y = 1"
    assert as_cell("1 +") == "1 +"  # left for the sandbox to report


def test_step_runs_code_and_ends_on_an_answer():
    env = PythonToolEnv(answer_reward=True)
    sample = Sample(prompt="37*48=", label="1776")

    async def go():
        messages, tools = await env.start(sample)
        ran = await env.step(sample, "<code>37*48</code>")
        cells = [(await env.step(sample, f"<code>{c}</code>"))[0][0]["content"]
                 for c in ("x = 6\nx * 7", "print(37*48)", "y = 1", "print(1)\nNone")]
        failed = await env.step(sample, "<code>1/0</code>")
        right = await env.step(sample, "1776")
        wrong = await env.step(sample, "1777")
        return messages, tools, ran, cells, failed, right, wrong
    messages, tools, ran, cells, failed, right, wrong = asyncio.run(go())
    assert [m["role"] for m in messages] == ["system", "user"] and messages[1]["content"] == "37*48="
    assert tools == [PYTHON_TOOL]
    assert ran[:3] == ([{"role": "tool", "content": "1776"}], False, 0.0)  # the environment's reward alone
    assert cells == ["42", "1776", "", "1"]  # a notebook cell's rule: a last value shown unless None
    assert ran[3]["tool_calls"] == 1 and ran[3]["tool_errors"] == 0 and ran[3]["tool_time_s"][0] > 0
    assert failed[0] == [{"role": "tool", "content": "ZeroDivisionError: division by zero"}]
    assert failed[3]["tool_errors"] == 1
    assert right[:3] == ([], True, 1.0) and wrong[:3] == ([], True, 0.0)


def test_number_answer_env_reads_the_final_number_and_plain_env_leaves_the_reward():
    """make_number_answer_env (the SmolLM2 tool task's): the reply's last number against the label;
    make_env gives no reward of its own, tool turns included (the run's --rm-type scores the episode)."""
    sample = Sample(prompt="What is 341 * 48? Use Python.", label="16368")
    env, plain = make_number_answer_env(None), make_env(None)

    async def go():
        return ([(await env.step(sample, r))[2] for r in ("The answer is 16368.", "16368", "16,368", "1636",
                                                            "no idea", "```python\n341 * 48\n```")],
                [(await plain.step(sample, r))[2] for r in ("16368", "```python\n341 * 48\n```")])
    number, plain_rewards = asyncio.run(go())
    assert number == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert plain_rewards == [None, None]
    # the user-turn variant: the tool's answer comes back as a user message asking for the number
    messages, done, reward, info = asyncio.run(make_number_answer_user_env(None).step(sample, "```python\n341 * 48\n```"))
    assert messages == [{"role": "user", "content": "The code printed: 16368\nReply with the number alone."}]
    assert (done, reward, info["tool_calls"]) == (False, 0.0, 1)


def _episode(env, replies: list[str], label: str = "16368") -> tuple[list, list, Sample]:
    """Step ``env`` through ``replies`` on a fresh sample: each turn's reward and ``info["correct"]``."""
    sample = Sample(prompt="What is 341 * 48? Use Python.", label=label)

    async def go():
        return [await env.step(sample, r) for r in replies]
    steps = asyncio.run(go())
    return [s[2] for s in steps], [s[3].get("correct") for s in steps], sample


def test_shaped_reward_credits_the_first_right_tool_output_once_and_totals_one():
    """make_shaped_user_env (the SmolLM2 tool config's): a tool output whose last number is the label
    earns TOOL_ANSWER_REWARD once; a right final answer the rest of 1.0; every step marks correct."""
    env, r = make_shaped_user_env(None), TOOL_ANSWER_REWARD
    code, wrong_code = "```python\nprint(341 * 48)\n```", "```python\nprint(341 * 47)\n```"
    rewards, correct, sample = _episode(env, [code, "```python\nx = 341 * 48\nf'341*48 = {x}'\n```", "16368"])
    assert rewards == [r, 0.0, 1.0 - r] and sum(rewards) == 1.0  # a second right output earns nothing
    assert correct == [False, False, True]
    assert sample.metadata["agent"]["env"] == {"earned": r}  # the episode's state, where the loop keeps it
    assert _episode(env, [code, "1636"])[:2] == ([r, 0.0], [False, False])  # only the tool was right
    assert _episode(env, [wrong_code, code, "16368"])[0] == [0.0, r, 1.0 - r]
    assert _episode(env, [wrong_code, "16368"])[0] == [0.0, 1.0]  # right without the tool's help
    assert _episode(env, ["16368"])[:2] == ([1.0], [True])
    assert _episode(env, ["```python\nprint(16368 +)\n```", "no idea"])[:2] == ([0.0, 0.0], [False, False])
    # the unshaped env gives no tool credit, and marks the same way
    assert _episode(make_number_answer_user_env(None), [code, "16368"])[:2] == ([0.0, 1.0], [False, True])
    assert _episode(make_env(None), [code, "16368"])[:2] == ([None, None], [None, None])  # the run's reward
    for bad, why in (({"tool_answer_reward": 1.0, "answer_reward": True}, "in \\[0, 1\\)"),
                     ({"tool_answer_reward": 0.2}, "needs answer_reward=True")):
        with pytest.raises(ValueError, match=why):
            PythonToolEnv(**bad)


def _first_stop(tok, text: str, stop: list[str]) -> str | None:
    """What the embedded engine generates of ``text`` under ``stop`` (fed one token at a time to its
    scheduler's match, as decoding does): the decoded output up to the token that ends it; None when
    no stop fires."""
    from types import SimpleNamespace

    from embedded_engine.protocol import SamplingParams
    from embedded_engine.scheduler import Scheduler

    engine = SimpleNamespace(runner=SimpleNamespace(tokenizer=tok))
    req = SimpleNamespace(params=SamplingParams(stop=tuple(stop), skip_special_tokens=False), output_ids=[])
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        req.output_ids.append(t)
        if Scheduler._match_stop_str(engine, req) is not None:
            return tok.decode(req.output_ids)
    return None


def _fence_tokenizer():
    """A byte-level BPE tokenizer (SmolLM2's kind; the toy's has no backtick) trained here on a few
    replies: it splits them as SmolLM2's does (``'```'``, ``'python'``, ``'\\n'``, ...)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["Sure:\n```python\nprint(341 * 48)\n```\nThe answer is 16368."] * 50
                            + ["Here:\n```\nx = 1\n```\n\nok"] * 20, vocab_size=300, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)


def test_code_block_stop_ends_the_turn_after_the_closed_block_only():
    """CODE_BLOCK_STOP (the SmolLM2 tool config's --rollout-stop) on the embedded engine's match:
    not at a ```python fence, right after the closing one; the kept reply still holds the code; at a
    bare opening fence PythonToolEnv.continue_turn says go on."""
    tok = _fence_tokenizer()
    assert "```" in [tok.decode([t]) for t in tok("```python\n", add_special_tokens=False)["input_ids"]]
    reply = "Sure:\n```python\nprint(341 * 48)\n```\nThe answer is 16368, because 341 * 48 is"
    kept = _first_stop(tok, reply, [CODE_BLOCK_STOP])
    assert kept == "Sure:\n```python\nprint(341 * 48)\n```\n" and extract_code(kept) == "print(341 * 48)\n"
    assert _first_stop(tok, "```python\nx = 341 * 48\nprint(x)", [CODE_BLOCK_STOP]) is None  # still open
    assert _first_stop(tok, "The answer is 16368.", [CODE_BLOCK_STOP]) is None
    env = PythonToolEnv()
    assert not env.continue_turn(None, kept)  # the block is closed: the turn is over
    # a bare opening fence after text stops it too, before its code: continue_turn has the loop go on,
    # and the stop fires again (on the new text only) at the close
    bare = "Here:\n```\nprint(1)\n```\nok"
    cut = _first_stop(tok, bare, [CODE_BLOCK_STOP])
    assert cut == "Here:\n```\n" and extract_code(cut) is None and env.continue_turn(None, cut)
    rest = _first_stop(tok, bare[len(cut):], [CODE_BLOCK_STOP])
    assert rest == "print(1)\n```\n" and extract_code(cut + rest) == "print(1)\n"
    assert not env.continue_turn(None, cut + rest)


def test_episode_with_the_python_tool(toy_model_dir):
    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    ids = tok("<code>6*7</code>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    async def go():
        argv = toy_argv(toy_model_dir, "--rollout-engine", "instant", "--rollout-num-engines", "1",
                        "--engine-extra-args", f"--output-ids {','.join(map(str, ids))}",
                        "--agent-env", "plugins.python_env.make_env", "--agent-max-turns", "3",
                        "--n-samples-per-prompt", "2", "--rollout-batch-size", "1", "--rollout-max-response-len", "400")
        async with running_manager(argv) as m:
            return await m.generate(0)
    groups, metrics = asyncio.run(go())
    for s in groups[0]:
        assert s.status == Status.COMPLETED and s.loss_mask == turn_masks(s)
        state, turns = s.metadata[AGENT_STATE], s.metadata[AGENT_TURNS]
        assert state["end_reason"] == "max_turns" and state["tool_calls"] == 3 and state["tool_errors"] == 0
        assert [m["content"] for m in state["messages"] if m["role"] == "tool"] == ["42", "42"]  # the third ran, unseen
        assert [t["kind"] for t in turns] == ["model", "env", "model", "env", "model"]
        assert "42" in tok.decode(s.tokens[turns[1]["start"]:turns[1]["end"]])
    assert metrics["rollout/agent/tool_calls"] == 6 and metrics["rollout/agent/tool_errors"] == 0
    assert metrics["rollout/agent/tool_time_p95_s"] > 0 and "rollout/agent/loop_lag_p95_s" in metrics
