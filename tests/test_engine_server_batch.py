"""The embedded engine's batch ``/generate`` over real HTTP (SGLang's form; what a group request of
the rollout sends): answers in order and equal to single requests, per-element errors with nothing
started, abort of one element by its rid, abort_all and pause(abort), a disconnect frees every
element. Needs loopback sockets: run via scripts/run_tests.sh (``unshare -n``)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from _fixtures_engine import engine_model, engine_url, run  # noqa: F401
from sglang_protocol.client import EngineClient, EngineError

LONG = {"max_new_tokens": 240, "ignore_eos": True, "temperature": 1.0}
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


async def _load(c: EngineClient) -> dict:
    return (await c.request("GET", "/get_load"))[0]


async def _wait(c: EngineClient, key: str, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (await _load(c))[key] != n:
        assert time.monotonic() < deadline, f"{key} never reached {n}"
        await asyncio.sleep(0.005)


def test_batch_answers_in_order_like_single_requests(engine_url):
    greedy = {"temperature": 0, "max_new_tokens": 12}

    async def go():
        async with EngineClient(engine_url, timeout=60) as c:
            singles = [await c.generate(input_ids=p, sampling_params=greedy) for p in PROMPTS]
            batch = await c.generate_batch(PROMPTS, sampling_params=greedy, rid="grp")
            no_rid = await c.generate_batch(PROMPTS[::-1], sampling_params=greedy, return_logprob=False)
            # the list forms SGLang also accepts (sglang-router does not forward them)
            lists = await c.request("POST", "/generate", {
                "input_ids": PROMPTS[:2], "rid": ["u", "v"], "return_logprob": [True, False],
                "sampling_params": [greedy, {**greedy, "max_new_tokens": 3}]})
            return singles, batch, no_rid, lists

    singles, batch, no_rid, lists = run(go())
    assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in singles]
    assert [b["meta_info"]["id"] for b in batch] == ["grp_0", "grp_1", "grp_2"]
    for b, s in zip(batch, singles):
        assert [t for _, t, _ in b["meta_info"]["output_token_logprobs"]] == b["output_ids"]
        assert b["meta_info"]["prompt_tokens"] == s["meta_info"]["prompt_tokens"]
        assert max(abs(x[0] - y[0]) for x, y in zip(b["meta_info"]["output_token_logprobs"],
                                                   s["meta_info"]["output_token_logprobs"])) < 1e-4
    assert [b["output_ids"] for b in no_rid] == [s["output_ids"] for s in singles[::-1]]
    assert "output_token_logprobs" not in no_rid[0]["meta_info"]
    assert [x["meta_info"]["id"] for x in lists] == ["u", "v"]
    assert lists[0]["output_ids"] == singles[0]["output_ids"] and len(lists[1]["output_ids"]) <= 3
    assert "output_token_logprobs" in lists[0]["meta_info"] and "output_token_logprobs" not in lists[1]["meta_info"]


def test_bad_element_gets_400_naming_it_and_nothing_starts(engine_url):
    async def finished(c):
        return (await c.server_info())["internal_states"][0]["finished_reqs"]

    async def go():
        out = []
        async with EngineClient(engine_url, timeout=30) as c, aiohttp.ClientSession() as s:
            before = await finished(c)
            for body in ({"input_ids": [[5], [100000], [6]]}, {"input_ids": [[5], list(range(1, 60)) * 5]},
                         {"input_ids": [[5], [6]], "sampling_params": [{}, {"top_p": 2}]},
                         {"input_ids": [[5], [6]], "rid": ["same", "same"]}):
                async with s.post(engine_url + "/generate", json=body) as r:
                    out.append((r.status, (await r.json())["error"]["message"]))
            assert await finished(c) == before  # no element of a rejected batch ran
            # an element whose rid is in flight: the batch is refused, the elements queued before it withdrawn
            await c.pause_generation("in_place")
            try:
                held = asyncio.create_task(c.generate(input_ids=[5], sampling_params=LONG, rid="busy_1"))
                await _wait(c, "num_reqs", 1)
                with pytest.raises(EngineError) as e:
                    await c.generate_batch(PROMPTS, sampling_params=LONG, rid="busy")
                await _wait(c, "num_reqs", 1)
                await c.abort_request(rid="busy_1")
                await held
            finally:
                await c.continue_generation()
        return out, e.value

    out, busy = run(go())
    assert [st for st, _ in out] == [400] * 4
    for (_, msg), f in zip(out, ["input_ids[1]", "input_ids[1]", "sampling_params[1].top_p", "rid[1]"]):
        assert msg.startswith(f + ": "), (msg, f)
    assert busy.status == 400 and "rid[1]" in busy.body and "in flight" in busy.body


def test_abort_one_element_then_abort_all_and_pause(engine_url):
    async def go():
        async with EngineClient(engine_url, timeout=60) as c:
            # 1. abort one element by its rid: only it stops, with what it generated so far
            task = asyncio.create_task(c.generate_batch(PROMPTS, sampling_params=LONG, rid="ab"))
            await _wait(c, "num_running_reqs", 3)
            await c.pause_generation("in_place")  # hold them mid-generation, so the abort meets a running row
            await c.abort_request(rid="ab_1")
            await _wait(c, "num_reqs", 2)
            await c.continue_generation()
            one = await task
            # 2. abort_all reaches every element (queued here: the engine is paused)
            await c.pause_generation("in_place")
            task = asyncio.create_task(c.generate_batch(PROMPTS, sampling_params=LONG, rid="all"))
            await _wait(c, "num_reqs", 3)
            await c.abort_request(abort_all=True)
            every = await task
            await c.continue_generation()
            # 3. pause in abort mode aborts every running element
            task = asyncio.create_task(c.generate_batch(PROMPTS, sampling_params=LONG, rid="pz"))
            await _wait(c, "num_running_reqs", 3)
            await c.pause_generation("abort")
            paused = await task
            await c.continue_generation()
            return one, every, paused

    one, every, paused = run(go())
    kinds = [o["meta_info"]["finish_reason"]["type"] for o in one]
    assert kinds == ["length", "abort", "length"]
    m = one[1]["meta_info"]
    assert 0 < m["completion_tokens"] < 240 and len(m["output_token_logprobs"]) == m["completion_tokens"]
    assert [o["meta_info"]["completion_tokens"] for o in (one[0], one[2])] == [240, 240]
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in every + paused)
    assert [o["meta_info"]["id"] for o in paused] == ["pz_0", "pz_1", "pz_2"]


def test_client_disconnect_frees_every_element(engine_url):
    async def go():
        async with EngineClient(engine_url, timeout=30) as c:
            await c.pause_generation("in_place")  # the elements wait, so only the disconnect can free them
            try:
                with pytest.raises(EngineError):
                    await c.generate_batch(PROMPTS, sampling_params=LONG, timeout=0.5)
                await _wait(c, "num_reqs", 0, timeout=5)
            finally:
                await c.continue_generation()
            return await c.generate_batch(PROMPTS[:2], sampling_params={"max_new_tokens": 2}, rid="after")

    after = run(go())
    assert len(after) == 2 and all(1 <= len(o["output_ids"]) <= 2 for o in after)  # the engine serves on
