"""Built-in rewards, the reward dispatcher's failure handling, and the dynamic-sampling filter."""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import types

import pytest

from buffer.sample import Sample, Status
from plugins.filters import check_reward_nonzero_std
from plugins.rewards import exact_match_rm, extract_answer, math_rm, toy_arithmetic_rm
from rollout_manager.rewards import Rewarder
from rollout_manager.settings import PluginSettings


def _s(response: str, label="19", index=0) -> Sample:
    return Sample(index=index, group_index=0, response=response, label=label, tokens=[1, 2], response_length=1,
                  loss_mask=[1], status=Status.COMPLETED, weight_versions=[0])


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("text,answer", [
    ("so the answer is \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("\\boxed{x^{2}} and later \\boxed{42}", "42"),
    ("I think 3 then 1,234 apples", "1,234"),
    ("no digits here", None),
    ("\\boxed{unclosed", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("response,label,reward", [
    ("The sum is 19.", "19", 1.0), ("\\boxed{19}", "19", 1.0), ("19.0", "19", 1.0), ("1,234", "1234", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("18", "19", 0.0), ("", "19", 0.0),
    ("answer: \\boxed{x+1}", "\\boxed{x + 1}", 1.0),
])
def test_math_rm(response, label, reward):
    assert run(math_rm(None, _s(response, label))) == reward


@pytest.mark.parametrize("response,reward", [
    ("19", 1.0), ("19<eos>", 1.0), (" 19 <eos>", 1.0), ("19</s>", 1.0), ("190", 0.0), ("1<eos>9", 0.0),
    ("19<eos><eos>", 0.0), ("19 is it", 0.0), ("", 0.0),
])
def test_toy_arithmetic_rm(response, reward):
    assert run(toy_arithmetic_rm(None, _s(response))) == reward


def test_exact_match_and_missing_label():
    assert run(exact_match_rm(None, _s(" yes ", "yes"))) == 1.0
    assert run(exact_match_rm(None, _s("yes!", "yes"))) == 0.0
    with pytest.raises(ValueError, match="no label"):
        run(exact_match_rm(None, _s("x", None)))


@pytest.fixture
def rm_module(monkeypatch):
    mod = types.ModuleType("rollout_test_rms")

    async def flaky(args, sample):
        if sample.index == 1:
            raise KeyError("boom")
        if sample.index == 2:
            return float("nan")
        if sample.index == 3:
            return "high"
        return 0.5

    def batched(args, samples):
        return [float(s.index) for s in samples]

    def batched_short(args, samples):
        return [1.0]

    def plain(args, sample):  # a plain per-sample reward: runs in a plugin thread
        return 1.0 if threading.current_thread() is not threading.main_thread() else -1.0

    release = threading.Event()

    def stuck(args, sample):  # blocks its thread until the test lets it go
        release.wait(60)
        return 1.0

    async def stuck_async(args, sample):
        await asyncio.Event().wait()

    mod.flaky, mod.batched, mod.batched_short = flaky, batched, batched_short
    mod.plain, mod.stuck, mod.stuck_async, mod.release = plain, stuck, stuck_async, release
    monkeypatch.setitem(sys.modules, "rollout_test_rms", mod)
    return mod


def test_reward_failures_mark_only_that_sample(rm_module):
    r = Rewarder(PluginSettings(custom_rm_path="rollout_test_rms.flaky"), argparse.Namespace())
    samples = [_s("x", index=i) for i in range(5)]

    async def go():
        await asyncio.gather(*(r.score(s) for s in samples))
    run(go())
    assert [s.status for s in samples] == [Status.COMPLETED, Status.FAILED, Status.FAILED, Status.FAILED,
                                          Status.COMPLETED]
    assert samples[0].reward == 0.5 and samples[4].reward == 0.5 and samples[1].reward is None
    assert samples[1].metadata["failure_reason"] == "reward: KeyError"
    assert samples[2].metadata["failure_reason"] == "reward: ValueError"  # non-finite
    assert samples[3].metadata["failure_reason"] == "reward: TypeError"


def test_group_rm(rm_module):
    r = Rewarder(PluginSettings(custom_rm_path="rollout_test_rms.batched", group_rm=True), argparse.Namespace())
    group = [_s("x", index=i) for i in range(3)]
    group[1].status = Status.FAILED  # a failed sample is not scored
    run(r.score_group(group))
    assert [s.reward for s in group] == [0.0, None, 2.0]
    r = Rewarder(PluginSettings(custom_rm_path="rollout_test_rms.batched_short", group_rm=True), argparse.Namespace())
    group = [_s("x", index=i) for i in range(3)]
    run(r.score_group(group))
    assert all(s.status == Status.FAILED for s in group)


def test_custom_rm_errors_name_flag_and_path(rm_module):
    with pytest.raises(ValueError, match=r"--custom-rm-path 'no_such_mod_xyz.rm': cannot import"):
        Rewarder(PluginSettings(custom_rm_path="no_such_mod_xyz.rm"), argparse.Namespace())


def test_filter_drops_equal_rewards():
    args = argparse.Namespace(reward_key=None)
    g = [_s("x", index=i) for i in range(3)]
    for s, r in zip(g, [1.0, 1.0, 1.0]):
        s.reward = r
    assert not check_reward_nonzero_std(args, g)
    g[2].reward = 0.0
    assert check_reward_nonzero_std(args, g)
    g[0].reward = g[1].reward = None  # failed samples: one scored sample left is not a spread
    assert not check_reward_nonzero_std(args, g)


def test_remote_reward_model():
    from aiohttp import web

    from sglang_protocol.net import free_port

    async def handler(request):
        body = await request.json()
        if body["response"] == "bad":
            return web.Response(status=500, text="model exploded")
        return web.json_response({"reward": 1.0 if body["response"].strip() == body["label"] else 0.0})

    async def go():
        app = web.Application()
        app.router.add_post("/rm", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            url = f"http://127.0.0.1:{port}/rm"
            r = Rewarder(PluginSettings(rm_url=url), argparse.Namespace(rm_url=url))
            samples = [_s("19", index=0), _s("7", index=1), _s("bad", index=2)]
            await asyncio.gather(*(r.score(s) for s in samples))
            return samples
        finally:
            await runner.cleanup()
    samples = run(go())
    assert [s.reward for s in samples] == [1.0, 0.0, None]
    assert samples[2].status == Status.FAILED and samples[2].metadata["failure_reason"] == "reward: RuntimeError"


def test_plain_reward_runs_off_the_loop_and_timeouts_fail_only_their_samples(rm_module):
    r = Rewarder(PluginSettings(custom_rm_path="rollout_test_rms.plain"), argparse.Namespace())
    s = _s("x")
    run(r.score(s))
    assert s.reward == 1.0  # it ran in a plugin thread, not on the loop's (main) thread
    for name in ("stuck", "stuck_async"):
        r = Rewarder(PluginSettings(custom_rm_path=f"rollout_test_rms.{name}", reward_timeout=0.2),
                     argparse.Namespace())
        group = [_s("x", index=i) for i in range(3)]
        run(asyncio.wait_for(r.score_group(group), 30))  # bounded by the reward timeout, not by the plugin
        assert [(x.status, x.metadata["failure_reason"]) for x in group] == [(Status.FAILED, "reward: timeout")] * 3
    rm_module.release.set()


# --- slime's rule types: each on inputs where it and Reservoir's math rule disagree ------------------------------

def _scored(rm_type: str, response: str, label, metadata=None, reward_key=None):
    """The reward the rollout manager's dispatcher gives with ``--rm-type rm_type``."""
    from plugins.rewards import check_rm_type

    check_rm_type(rm_type, reward_key)
    sample = _s(response, label)
    sample.metadata = metadata or {}
    run(Rewarder(PluginSettings(rm_type=rm_type, reward_key=reward_key), argparse.Namespace()).score(sample))
    assert sample.status != Status.FAILED, sample.metadata
    return sample.reward


@pytest.mark.parametrize("rm_type,response,label,metadata,want,math_gives", [
    # dapo: the last "Answer:" line decides, a wrong one scores -1, a boxed answer alone is not read
    ("dapo", "steps... Answer: 42", "42", None, 1.0, 1.0),
    ("dapo", "so \\boxed{42}", "42", None, -1.0, 1.0),
    ("dapo", "Answer: 41", "42", None, -1.0, 0.0),
    # f1: partial credit on word overlap; articles and punctuation do not count; yes/no must match
    ("f1", "The Eiffel tower, in Paris", "Eiffel Tower", None, 2 * (2 / 4) * 1 / (2 / 4 + 1), 0.0),
    ("f1", "no", "no.", None, 1.0, 0.0),
    ("f1", "yes it is 3", "3", None, 2 * 0.25 / 1.25, 1.0),
    # gpqa: the named option letter, the correct option's text, an index label
    ("gpqa", "<think>maybe A</think>The answer is B.", "B", None, 1.0, 0.0),
    ("gpqa", "The answer is (B).", "B", None, 0.0, 0.0),  # slime's pattern reads the "i" of "is" here
    ("gpqa", "I pick choice c", "", {"correct_letter": "C"}, 1.0, None),
    ("gpqa", "final answer: 2 moles, option A", 1, {"choices": ["2 moles", "4 moles"]}, 0.0, None),
    ("gpqa", "it must be 4 moles", "4 moles", {"choices": ["2 moles", "4 moles"]}, 1.0, 0.0),
    ("gpqa", "so 4 moles", 1, {"choices": ["2 moles", "4 moles"]}, 1.0, None),
    ("gpqa", "so 2 moles", 1, {"choices": ["2 moles", "4 moles"]}, 0.0, None),
    # boxed_: the rule sees only the last boxed content
    ("boxed_f1", "\\boxed{Eiffel tower} in Paris", "the Eiffel Tower", None, 1.0, 0.0),
    ("boxed_exact_match", "reasoning \\boxed{19}", "19", None, 1.0, 1.0),
    ("boxed_math", "the answer is 19, not boxed", "19", None, 0.0, 1.0),
])
def test_slime_rule_types(rm_type, response, label, metadata, want, math_gives):
    key = "score" if "dapo" in rm_type else None
    reward = _scored(rm_type, response, label, metadata, key)
    got = reward[key] if key else reward
    assert got == pytest.approx(want)
    if math_gives is not None:
        assert run(math_rm(None, _s(response, str(label)))) == math_gives


def test_random_rule_gives_both_values():
    seen = {_scored("random", "x", "y") for _ in range(64)}
    assert seen == {0, 1}


@pytest.mark.parametrize("rm_type,reward_key,msg", [
    ("ifbench", None, "--rm-type ifbench: not supported: slime's ifbench rule runs IFBench's instruction checkers"),
    ("boxed_ifbench", None, "--rm-type boxed_ifbench: not supported"),
    ("dapo", None, "--rm-type dapo returns DAPO's dict {score, acc, pred}: add --reward-key score"),
    ("boxed_remote_rm", None, "--rm-type 'boxed_remote_rm': choose one of"),
])
def test_rule_types_that_cannot_run_are_named(rm_type, reward_key, msg):
    from plugins.rewards import check_rm_type

    with pytest.raises(ValueError) as e:
        check_rm_type(rm_type, reward_key)
    assert msg in str(e.value)


def test_slime_async_rm_dispatches_the_new_rules():
    import slime_compat

    slime_compat.install()
    from slime.rollout.rm_hub import async_rm
    from slime.rollout.rm_hub.f1 import f1_score
    from slime.rollout.rm_hub.gpqa import compute_gpqa_reward

    args = argparse.Namespace(custom_rm_path=None, rm_type="math")
    sample = _s("the answer is B", "B")
    sample.metadata = {"rm_type": "gpqa"}  # a sample's own rm_type wins, as in slime
    assert run(async_rm(args, sample)) == 1.0
    assert f1_score("x y", "y z")[0] == pytest.approx(0.5) and compute_gpqa_reward("B is correct", "B") == 1.0
    sample.metadata = {"rm_type": "ifbench"}
    with pytest.raises(NotImplementedError, match="IFBench"):
        run(async_rm(args, sample))
