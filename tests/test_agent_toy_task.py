"""The toy tool task (scripts/make_toy_model.py --tool-task, docs/agent.md): a <|tool|> role token
added without changing the toy model of every other test, products the toy cannot compute in its
head, warm-up transcripts with the tool's turn out of the loss, and an episode with the real toy
model (embedded engine) and the sandboxed Python tool."""

from __future__ import annotations

import asyncio

import pytest
from _fixtures_rollout import running_manager
from transformers import AutoTokenizer

from buffer.agent_turns import AGENT_STATE, AGENT_TURNS, turn_masks
from buffer.sample import Status
from plugins.chat_append import append_ids, check_append_stable
from scripts import make_toy_model


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return make_toy_model.main(["--out", str(tmp_path_factory.mktemp("tooltoy") / "model"), "--tool-task",
                                "--num-train", "64", "--num-eval", "8"])


def test_tool_role_is_added_last_and_only_with_the_flag(toy_model_dir, tool_model):
    plain, tool = AutoTokenizer.from_pretrained(toy_model_dir), AutoTokenizer.from_pretrained(tool_model)
    assert len(tool) == len(plain) + 1 and tool.convert_tokens_to_ids("<|tool|>") == len(plain)
    assert "<|tool|>" not in plain.get_vocab()
    assert all(tool.get_vocab()[t] == i for t, i in plain.get_vocab().items())  # every other id as it was
    check_append_stable(tool)  # the probe's tool turns render as one role token, appendable
    conversation = [{"role": "user", "content": "37*48="}, {"role": "assistant", "content": "<code>eval(q)</code>"}]
    new = append_ids(tool, conversation, [{"role": "tool", "content": "1776"}], ids=None)
    assert tool.convert_ids_to_tokens(new) == ["<|tool|>", "1", "7", "7", "6", "<|assistant|>"]


def test_tool_task_rows_and_warmup_masks(tool_model):
    import json

    rows = [json.loads(x) for x in open(tool_model / "data" / "train.jsonl")]
    assert all(eval(r["prompt"].rstrip("=")) == int(r["label"]) and len(r["prompt"]) == 6 for r in rows)
    tok = AutoTokenizer.from_pretrained(tool_model)
    prompt, rest, mask = make_toy_model._tool_example(tok, {"prompt": "37*48=", "label": "1776"}, True)
    learned = "".join(t for t, m in zip(tok.convert_ids_to_tokens(rest), mask) if m)
    assert learned == "<code>eval(q)</code><eos>1776<eos>"  # the assistant turns; the tool's turn and glue not
    prompt, rest, mask = make_toy_model._tool_example(tok, {"prompt": "37*48=", "label": "1776"}, False)
    assert tok.decode(rest) == "1776<eos>" and mask == [1] * 5


def test_an_episode_on_the_tool_task_with_the_python_tool(tool_model):
    """The tool-task tokenizer through the agent loop and the sandbox (the instant engine answers the
    task's call, eval(q), every turn): the tool's turn renders as <|tool|> + the product + the next
    generation prompt."""
    tok = AutoTokenizer.from_pretrained(tool_model)
    call = tok(make_toy_model.TOOL_CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    async def go():
        argv = ["--hf-checkpoint", str(tool_model), "--prompt-data", str(tool_model / "data" / "train.jsonl"),
                "--agent-env", "plugins.python_env.make_toy_tool_env",
                "--agent-max-turns", "2", "--rollout-max-response-len", "60", "--n-samples-per-prompt", "2",
                "--rollout-batch-size", "1", "--rollout-engine", "instant", "--rollout-num-engines", "1",
                "--engine-extra-args", f"--output-ids {','.join(map(str, call))}", "--rm-type", "exact_match",
                "--tito-check", "fail"]
        async with running_manager(argv) as m:
            return await m.generate(0)
    groups, metrics = asyncio.run(go())
    for s in groups[0]:
        assert s.status == Status.COMPLETED and s.loss_mask == turn_masks(s)
        env = [t for t in s.metadata[AGENT_TURNS] if t["kind"] == "env"]
        product = str(eval(s.prompt.rstrip("=")))  # the tool computed the prompt's product (q)
        assert len(env) == 1 and tok.convert_ids_to_tokens(s.tokens[env[0]["start"]:env[0]["end"]]) == \
            ["<|tool|>", *product, "<|assistant|>"]
        assert s.metadata[AGENT_STATE]["end_reason"] == "max_turns" and s.reward == 0.0
    assert metrics["rollout/failed_frac"] == 0 and metrics["rollout/agent/tool_calls"] == 4
    assert not any(k.startswith("rollout/tito/") and k.split("/")[-1] in ("prompt_mismatch", "not_append_only",
                   "mask_outside_engine", "mask_inside_engine") for k in metrics)


# Measured (10 steps, 8 prompts x 8, lr 1e-3, from the 800-step warm-up; seeds 1234, 7, 99 of the run):
# the last 3 steps' mean reward over the first 3's rose by 0.51, 0.32, 0.16 and tool use by 0.41, 0.27,
# 0.29 (reward 0.22-0.48 at step 0, 0.59-0.89 at step 9; the 10 steps took 37-63 s on a loaded 2-core
# box, the warm-up 3.4 CPU minutes). The bounds are about half the smallest rise seen.
STEPS, REWARD_RISE, TOOL_USE_RISE = 10, 0.08, 0.15


@pytest.mark.slow  # the warm-up and the RL steps take minutes of CPU; the tests above are the fast part
def test_the_tool_task_learns_on_the_cpu(tmp_path):
    """GRPO on the toy tool task, in process (tests/_fixtures_agent_task.py): the rollout manager with
    the agent loop and the sandboxed Python tool, the torch trainer, weights pushed each step.
    Reward and tool use rise (bounds: the measured runs above STEPS)."""
    from _fixtures_agent_task import train_tool_task

    model = make_toy_model.main(["--out", str(tmp_path / "model"), "--tool-task", "--warmup-steps", "800",
                                 "--warmup-batch-size", "16", "--tool-warmup-frac", "0.5"])
    log = train_tool_task(model, tmp_path, steps=STEPS, prompts=8, n=8, lr=1e-3)
    print("tool task:", [(round(r["reward"], 2), round(r["tool_use"], 2)) for r in log])
    k = STEPS // 3
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(log[-k:], "reward") > mean(log[:k], "reward") + REWARD_RISE, log
    assert mean(log[-k:], "tool_use") > mean(log[:k], "tool_use") + TOOL_USE_RISE, log
