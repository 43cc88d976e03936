"""Built-in rewards, the reward dispatcher's failure handling, and the dynamic-sampling filter."""

from __future__ import annotations

import argparse
import asyncio
import sys
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

    mod.flaky, mod.batched, mod.batched_short = flaky, batched, batched_short
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
    with pytest.raises(ValueError, match=r"--custom-rm-path 'rollout_test_rms.batched'.*async"):
        Rewarder(PluginSettings(custom_rm_path="rollout_test_rms.batched"), argparse.Namespace())
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

    from rollout_manager.router import free_port

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
