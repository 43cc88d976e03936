"""The agent loop (rollout_manager/agent.py, --agent-env): masks and log-probs follow its turn log,
budgets end episodes with a counted reason, a pause inside turn 2 keeps turn 1, bad paths fail in
one line. The engine is the instant one: each model turn answers the same fixed ids."""

from __future__ import annotations

import asyncio
import copy

import pytest
from _fixtures_agent import SEEN, TURN_REWARD, reset_seen, wait_steps
from _fixtures_rollout import make_args, push_during_pause, running_manager, toy_argv
from transformers import AutoTokenizer

from buffer.arrow import groups_to_record_batch, record_batch_to_groups
from buffer.sample import CORRECT, Sample, Status, check_sample
from buffer.agent_turns import AGENT_STATE, AGENT_TURNS, turn_masks, turns_for_training
from rollout_manager.manager import RolloutManager
from rollout_manager.summary import eval_data_metrics, rollout_metrics

INSTANT = ["--rollout-engine", "instant", "--rollout-num-engines", "1", "--health-check-interval", "0.5"]


def _reply_ids(model_dir) -> list[int]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok("<code>2+2</code>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def _run(model_dir, *extra: str, engine_args: str = ""):
    ids = _reply_ids(model_dir)
    reset_seen()

    async def go():
        argv = toy_argv(model_dir, *INSTANT, "--engine-extra-args", f"--output-ids {','.join(map(str, ids))} "
                        + engine_args, "--n-samples-per-prompt", "2", "--rollout-batch-size", "2",
                        "--rollout-max-response-len", "200", *extra)
        async with running_manager(argv) as m:
            return await m.generate(0)
    groups, metrics = asyncio.run(go())
    return [s for g in groups for s in g], metrics, ids


def _check_turns(s, ids: list[int]) -> list[dict]:
    """Masks and log-probs equal what the turn log says; model turns hold the engine's ids."""
    check_sample(s)
    turns = s.metadata[AGENT_TURNS]
    assert [t["kind"] for t in turns] == ["model", "env"] * (len(turns) // 2) + ["model"] * (len(turns) % 2)
    assert turns[0]["start"] == s.prompt_length and turns[-1]["end"] == len(s.tokens)
    assert all(a["end"] == b["start"] for a, b in zip(turns, turns[1:]))  # contiguous, nothing between
    assert s.loss_mask == turn_masks(s)
    for t in turns_for_training(s):
        logps = s.rollout_log_probs[t["start"]:t["end"]]
        assert logps == ([-0.5] * len(logps) if t["kind"] == "model" else [0.0] * len(logps))
        assert not t["open"]
    return turns


def test_masks_and_logprobs_follow_the_turn_log(toy_model_dir):
    samples, metrics, ids = _run(toy_model_dir, "--agent-env", "_fixtures_agent.three_turns", "--tito-check", "fail")
    assert len(samples) == 4 and metrics["rollout/failed_frac"] == 0
    for s in samples:
        turns = _check_turns(s, ids)
        assert s.status == Status.COMPLETED and len(turns) == 5
        for t in turns:
            if t["kind"] == "model":
                assert s.tokens[t["start"]:t["end"]] == ids and t["weight_versions"] == [0]
                assert t["reward"] == TURN_REWARD
            else:
                assert t["reward"] is None and t["end"] > t["start"]
        assert s.reward == 3 * TURN_REWARD  # the turn rewards, summed
        assert s.metadata[AGENT_STATE]["end_reason"] == "done"
        assert [m["role"] for m in s.metadata[AGENT_STATE]["messages"]] == ["user"] + ["assistant", "user"] * 2 + \
            ["assistant"]
    assert SEEN["replies"][0] == "<code>2+2</code>"  # the reply without the template's close (<eos>)
    assert metrics["rollout/agent/episodes"] == 4 and metrics["rollout/agent/turns_mean"] == 3
    assert metrics["rollout/agent/end/done"] == 4 and metrics["rollout/agent/tool_calls"] == 0
    assert metrics["rollout/tito/checked"] == 4 and not any("tito/" in k and k.split("/")[-1] in (
        "prompt_mismatch", "not_append_only", "mask_outside_engine", "mask_inside_engine") for k in metrics)
    # the turn log rides along into the buffer's Arrow / Parquet form
    back = record_batch_to_groups(groups_to_record_batch([samples]))[0]
    assert [x.metadata[AGENT_TURNS] for x in back] == [x.metadata[AGENT_TURNS] for x in samples]


def test_env_marks_correct_and_accuracy_counts_it_apart_from_the_reward(toy_model_dir):
    """info["correct"] of the last step becomes metadata["correct"]; accuracy reads it, not the reward."""
    samples, metrics, _ = _run(toy_model_dir, "--agent-env", "_fixtures_agent.three_turns_marked")
    assert all(s.metadata[CORRECT] is True and s.reward == 3 * TURN_REWARD for s in samples)
    assert metrics["rollout/accuracy"] == 1.0 and metrics["rollout/reward_mean"] == 3 * TURN_REWARD
    samples, metrics, _ = _run(toy_model_dir, "--agent-env", "_fixtures_agent.two_turns_marked", "--agent-max-turns",
                               "2")
    assert all(s.metadata[CORRECT] is False for s in samples) and metrics["rollout/accuracy"] == 0.0
    _, metrics, _ = _run(toy_model_dir, "--agent-env", "_fixtures_agent.three_turns")  # nothing marks
    assert "rollout/accuracy" not in metrics


def test_accuracy_is_the_marks_where_given_else_the_reward():
    """rollout_metrics / eval_data_metrics: eval/accuracy is Sample.correctness's mean (unmarked samples
    count their reward, as before the mark existed); failed samples (no reward) are left out."""
    def sample(reward, mark=None, status=Status.COMPLETED):
        return Sample(reward=reward, status=status, metadata={} if mark is None else {CORRECT: mark})
    shaped = [[sample(1.0, True), sample(0.2, False), sample(0.2, False), sample(None, status=Status.FAILED)]]
    m = rollout_metrics(shaped, None, 1.0, "eval")
    assert m["eval/accuracy"] == pytest.approx(1 / 3) and m["eval/reward_mean"] == pytest.approx(1.4 / 3)
    plain = [[sample(1.0), sample(0.5), sample(0.0)]]
    assert rollout_metrics(plain, None, 1.0, "eval")["eval/accuracy"] == 0.5  # the mean reward, as before
    assert "rollout/accuracy" not in rollout_metrics(plain, None, 1.0)
    assert rollout_metrics(shaped + plain, None, 1.0)["rollout/accuracy"] == pytest.approx(2.5 / 6)
    data = {"toy": {"rewards": [1.0, 0.2, 0.5], "samples": [sample(1.0, True), sample(0.2, False), sample(0.5)]}}
    ev = eval_data_metrics(data)
    assert ev["eval/accuracy"] == 0.5 and ev["eval/toy"] == ev["eval/reward_mean"] == pytest.approx(1.7 / 3)
    with pytest.raises(ValueError, match="metadata\\['correct'\\] is 1"):
        sample(1.0, 1).correctness()


def test_a_turn_ended_by_a_stop_string_goes_on_when_the_env_says_so(toy_model_dir):
    """A model turn without the template's close (as a --rollout-stop string ends it) is offered to
    continue_turn; True generates on in the same turn (one model turn, two engine answers)."""
    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    ids = tok("<code>2+2</code>", add_special_tokens=False)["input_ids"]  # no <eos>: a stop string fired
    reset_seen()

    async def go():
        argv = toy_argv(toy_model_dir, *INSTANT, "--engine-extra-args", f"--output-ids {','.join(map(str, ids))}",
                        "--n-samples-per-prompt", "2", "--rollout-batch-size", "1", "--rollout-max-response-len", "200",
                        "--agent-env", "_fixtures_agent.continuing", "--tito-check", "fail")
        async with running_manager(argv) as m:
            return await m.generate(0)
    groups, metrics = asyncio.run(go())
    for s in groups[0]:
        turns = _check_turns(s, ids)
        assert [t["kind"] for t in turns] == ["model", "env", "model"] and s.status == Status.COMPLETED
        for t in turns[::2]:
            assert s.tokens[t["start"]:t["end"]] == ids + ids  # two engine answers in one turn
    assert SEEN["replies"] == ["<code>2+2</code>" * 2] * 4  # the environment stepped on whole turns only
    assert len(SEEN["continue_asked"]) == 8 and metrics["rollout/agent/turns_mean"] == 2
    # the check renders each turn as one message, its two engine answers together: no finding, soft ones included
    assert metrics["rollout/tito/checked"] == 2 and [k for k in metrics if k.startswith("rollout/tito/")] == [
        "rollout/tito/checked"]
    # a turn that ends with the template's close is never offered (the model ended it)
    _run(toy_model_dir, "--agent-env", "_fixtures_agent.continuing")
    assert "continue_asked" not in SEEN and SEEN["replies"] == ["<code>2+2</code>"] * 8  # 4 samples x 2 turns


def test_max_turns_ends_the_episode(toy_model_dir):
    samples, metrics, ids = _run(toy_model_dir, "--agent-env", "_fixtures_agent.endless", "--agent-max-turns", "2")
    for s in samples:
        turns = _check_turns(s, ids)
        assert [t["kind"] for t in turns] == ["model", "env", "model"]
        assert s.status == Status.COMPLETED and s.metadata[AGENT_STATE]["end_reason"] == "max_turns"
    assert metrics["rollout/agent/end/max_turns"] == 4 and metrics["rollout/agent/turns_mean"] == 2


def test_env_token_budget_ends_the_episode(toy_model_dir):
    # one env turn of the toy template: "<|user|>okN<|assistant|>"; the budget fits two and a bit
    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    env_turn = len(tok("<|user|>ok1<|assistant|>", add_special_tokens=False)["input_ids"])
    budget = 2 * env_turn + env_turn // 2
    samples, metrics, ids = _run(toy_model_dir, "--agent-env", "_fixtures_agent.endless", "--agent-max-env-tokens",
                                 str(budget))
    for s in samples:
        turns = _check_turns(s, ids)
        assert [t["kind"] for t in turns] == ["model", "env"] * 2 + ["model"]
        assert s.metadata[AGENT_STATE]["env_tokens"] == 2 * env_turn
        assert s.metadata[AGENT_STATE]["end_reason"] == "env_tokens"
    assert metrics["rollout/agent/end/env_tokens"] == 4


def test_response_budget_ends_the_episode_truncated(toy_model_dir):
    budget = 2 * len(_reply_ids(toy_model_dir)) + 12  # two model turns and a bit
    samples, metrics, ids = _run(toy_model_dir, "--agent-env", "_fixtures_agent.endless",
                                 "--rollout-max-response-len", str(budget))
    for s in samples:
        _check_turns(s, ids)
        assert s.status == Status.TRUNCATED and s.metadata[AGENT_STATE]["end_reason"] == "length"
        assert s.response_length <= budget
    assert metrics["rollout/agent/end/length"] == 4


def test_pause_inside_turn_two_keeps_turn_one(toy_model_dir):
    ids = _reply_ids(toy_model_dir)
    reset_seen()

    async def go():
        argv = toy_argv(toy_model_dir, *INSTANT, "--engine-extra-args",
                        f"--delay 1.0 --output-ids {','.join(map(str, ids))}", "--n-samples-per-prompt", "2",
                        "--rollout-batch-size", "1", "--rollout-max-response-len", "200", "--partial-rollout",
                        "--agent-env", "_fixtures_agent.three_turns")
        async with running_manager(argv) as m:
            task = asyncio.ensure_future(m.generate(0))
            await wait_steps(2)  # both samples finished turn 1 and sent turn 2
            step = SEEN["step_state"]
            while len(step.inflight) < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.15)  # the requests reach the engine (as wait_inflight settles)
            await push_during_pause(m)
            return await asyncio.wait_for(task, 30)
    groups, metrics = asyncio.run(go())
    assert metrics["rollout/aborted_requests"] == 2
    for s in (s for g in groups for s in g):
        turns = _check_turns(s, ids)
        assert len(turns) == 5 and s.status == Status.COMPLETED
        assert s.tokens[turns[0]["start"]:turns[0]["end"]] == ids and turns[0]["weight_versions"] == [0]
        # turn 2: half the ids before the pause (the instant engine's abort), then the whole answer again
        half = ids[:len(ids) // 2]
        assert s.tokens[turns[2]["start"]:turns[2]["end"]] == half + ids and turns[2]["weight_versions"] == [0, 1]
        assert turns[4]["weight_versions"] == [1]


@pytest.mark.parametrize("path,why", [
    ("_fixtures_agent.missing", "has no attribute 'missing'"),
    ("no_such_module.make_env", "cannot import module 'no_such_module'"),
    ("_fixtures_agent.broken_factory", "building the environment with (args) failed: RuntimeError: no sandbox here"),
    ("_fixtures_agent.no_step", "the environment has no step() method"),
])
def test_bad_env_path_is_a_one_line_error(toy_model_dir, path, why):
    args, settings = make_args(toy_argv(toy_model_dir, "--agent-env", path))
    with pytest.raises(ValueError) as e:
        RolloutManager(settings, args)
    assert str(e.value).startswith(f"--agent-env {path!r}") and why in str(e.value) and "\n" not in str(e.value)


def test_wind_down_inside_turn_two_resumes_next_step(toy_model_dir):
    """The step has its batch while group 1 is in turn 2: the group goes back with its turns, and the
    next step resumes the open turn with turn 1 untouched (--partial-rollout)."""
    ids = _reply_ids(toy_model_dir)
    reset_seen()

    async def go():
        argv = toy_argv(toy_model_dir, *INSTANT, "--engine-extra-args",
                        f"--delay 0.3 --output-ids {','.join(map(str, ids))}", "--n-samples-per-prompt", "2",
                        "--rollout-batch-size", "1", "--over-sampling-batch-size", "2",
                        "--rollout-max-response-len", "200", "--partial-rollout",
                        "--agent-env", "_fixtures_agent.quick_first_group")
        async with running_manager(argv) as m:
            first, _ = await m.generate(0)
            returned = [[s.copy(tokens=list(s.tokens), metadata=copy.deepcopy(s.metadata)) for s in g]
                        for g in m.data_source._returned]
            second, _ = await m.generate(1)
            return first, returned, second
    first, returned, second = asyncio.run(go())
    assert [g[0].group_index for g in first] == [0] and [g[0].group_index for g in returned] == [1]
    before = {s.index: s for s in returned[0]}
    resumed = [s for g in second for s in g if s.index in before]
    assert len(resumed) == 2
    for s in resumed:
        old = before[s.index]
        old_turns = old.metadata[AGENT_TURNS]
        assert [t["kind"] for t in old_turns] == ["model", "env", "model"] and old_turns[2]["open"]
        turns = _check_turns(s, ids)
        assert len(turns) == 5 and s.status == Status.COMPLETED
        assert turns[:2] == old_turns[:2]  # turn 1 and its env turn, as they were
        assert s.tokens[:old_turns[2]["end"]] == old.tokens  # everything held before the wind-down, kept
        assert s.tokens[turns[0]["start"]:turns[0]["end"]] == ids


def test_advantage_hook_gets_the_turns():
    """--custom-advantage-function-path sees each sample's turn log (spans relative to the response)
    and can give each model turn its own credit."""
    import argparse

    import torch

    from buffer.sample import Sample
    from train_backend.hooks import TrainHooks

    turns = [{"kind": "model", "start": 2, "end": 4, "weight_versions": [0], "reward": 1.0, "open": False},
             {"kind": "env", "start": 4, "end": 6, "weight_versions": [], "reward": None, "open": False},
             {"kind": "model", "start": 6, "end": 7, "weight_versions": [0], "reward": 0.5, "open": False}]
    s = Sample(tokens=list(range(7)), response_length=5, loss_mask=[1, 1, 0, 0, 1], rollout_log_probs=[-0.1] * 5,
               reward=1.5, status=Status.COMPLETED, metadata={AGENT_TURNS: turns})
    assert turn_masks(s) == s.loss_mask

    def per_turn_credit(args, data):
        out = []
        for n, log in zip(data["response_lengths"], data["turns"]):
            adv = torch.zeros(n)
            for t in log:
                if t["kind"] == "model":
                    adv[t["start"]:t["end"]] = t["reward"]
            out.append(adv)
        data["advantages"] = out

    hooks = TrainHooks(argparse.Namespace(), advantage=per_turn_credit)
    adv = hooks.rollout_data_step([s], [1.5], [1.5], 0, lambda prefix, xs: None if prefix else [[0.0] * 5],
                                  normalize=False)
    assert [list(map(float, a)) for a in adv] == [[1.0, 1.0, 0.0, 0.0, 0.5]]
