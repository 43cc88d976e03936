"""Embedded engine over real HTTP (an engine subprocess, the EngineClient): correctness against
transformers, log-probs, seeds, continuous batching, abort/pause, stops, bad input, info.

Needs loopback sockets: run inside ``unshare -n`` as CI does (see _fixtures_engine)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import torch

from _fixtures_engine import engine_model, engine_url, hf_model, reference_logprobs, run  # noqa: F401
from sglang_protocol.client import EngineClient, EngineError

LONG = {"max_new_tokens": 240, "ignore_eos": True, "temperature": 1.0}


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(123)
    return [torch.randint(7, 90, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


async def wait_running(c: EngineClient, n: int = 1, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (await c.request("GET", "/get_load"))[0]["num_running_reqs"] < n:
        assert time.monotonic() < deadline, "request never started running"
        await asyncio.sleep(0.002)


async def assert_held(c: EngineClient, task: asyncio.Task, waiting: int = 0, timeout: float = 10.0) -> None:
    """The paused engine holds ``task``'s request: once ``waiting`` requests are queued, the
    scheduler thread runs two commands (checksum reads run there between forwards), so it went
    past the request at least twice; still no decode step ran and the request has no answer."""
    deadline = time.monotonic() + timeout
    while (await c.request("GET", "/get_load"))[0]["num_waiting_reqs"] < waiting:
        assert time.monotonic() < deadline, "request never reached the engine"
        await asyncio.sleep(0.002)
    steps = (await c.server_info())["internal_states"][0]["decode_steps"]
    for _ in range(2):
        await c.request("POST", "/weights_checksum", {"names": ["model.norm.weight"]})
    assert (await c.server_info())["internal_states"][0]["decode_steps"] == steps
    assert not task.done(), "a paused engine must not serve requests"


def test_greedy_matches_transformers_generate(engine_url, engine_model):
    ps = prompts(6)

    async def go():
        async with EngineClient(engine_url, timeout=60) as c:
            return await asyncio.gather(*[c.generate(input_ids=p, sampling_params={
                "temperature": 0, "max_new_tokens": 24}) for p in ps])

    outs = run(go())
    model = hf_model(engine_model)
    for p, o in zip(ps, outs):
        ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             do_sample=False, max_new_tokens=24)[0, len(p):].tolist()
        assert o["output_ids"] == ref
        assert o["meta_info"]["completion_tokens"] == len(ref)
        assert o["meta_info"]["finish_reason"]["type"] in ("stop", "length")


@pytest.mark.parametrize("temperature,extra", [(1.0, {}), (0.6, {"top_p": 0.8, "top_k": 20}), (0.0, {})])
def test_logprobs_equal_full_forward(engine_url, engine_model, temperature, extra):
    ps = prompts(5)

    async def go():
        async with EngineClient(engine_url, timeout=60) as c:
            return await asyncio.gather(*[c.generate(input_ids=p, return_logprob=True, sampling_params={
                "temperature": temperature, "max_new_tokens": 30, "ignore_eos": True, "sampling_seed": i, **extra})
                for i, p in enumerate(ps)])

    model = hf_model(engine_model)
    for p, o in zip(run(go()), ps):
        lp = p["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in lp] == p["output_ids"] and all(x is None for _, _, x in lp)
        ref = reference_logprobs(model, o, p["output_ids"], temperature or 1.0)
        assert max(abs(a - b) for (a, _, _), b in zip(lp, ref)) <= 1e-5


def test_seed_reproducible_regardless_of_batch(engine_url):
    sp = {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 7}

    async def go():
        async with EngineClient(engine_url, timeout=60) as c:
            alone = await c.generate(input_ids=[10, 11, 12], sampling_params=sp)
            others = [c.generate(input_ids=p, sampling_params={"max_new_tokens": 20 + i, "temperature": 0.8})
                      for i, p in enumerate(prompts(8))]
            crowd = await asyncio.gather(*others[:4], c.generate(input_ids=[10, 11, 12], sampling_params=sp),
                                         *others[4:])
            unseeded = await asyncio.gather(*[c.generate(input_ids=[10, 11, 12], sampling_params={
                **sp, "sampling_seed": None}) for _ in range(2)])
            return alone, crowd[4], unseeded

    alone, crowded, unseeded = run(go())
    assert alone["output_ids"] == crowded["output_ids"]
    assert unseeded[0]["output_ids"] != unseeded[1]["output_ids"]


def test_continuous_batching_short_request_overtakes_long_one(engine_url):
    async def go():
        async with EngineClient(engine_url, timeout=60) as c:
            long = asyncio.create_task(c.generate(input_ids=[5, 6, 7], sampling_params=LONG))
            await wait_running(c)
            t0 = time.monotonic()
            short = await c.generate(input_ids=[8, 9], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
            t_short = time.monotonic() - t0
            assert not long.done(), "the long request should still be running"
            return short, t_short, await long

    short, t_short, long = run(go())
    assert short["meta_info"]["completion_tokens"] == 3 and long["meta_info"]["completion_tokens"] == 240
    assert long["meta_info"]["e2e_latency"] > short["meta_info"]["e2e_latency"]


def test_abort_returns_partial_tokens_and_abort_all(engine_url):
    async def go():
        async with EngineClient(engine_url, timeout=60) as c:
            a = asyncio.create_task(c.generate(input_ids=[5, 6], sampling_params=LONG, rid="abort-me"))
            await wait_running(c)
            await c.abort_request(rid="abort-me")
            ra = await a
            await c.pause_generation("in_place")  # requests queue up, so abort_all meets all of them
            many = [asyncio.create_task(c.generate(input_ids=p, sampling_params=LONG)) for p in prompts(4)]
            while (await c.request("GET", "/get_load"))[0]["num_reqs"] < 4:
                await asyncio.sleep(0.01)
            await c.abort_request(abort_all=True)
            rs = await asyncio.gather(*many)
            await c.continue_generation()
            after = await c.generate(input_ids=[5], sampling_params={"max_new_tokens": 2})
            return ra, rs, after

    ra, rs, after = run(go())
    m = ra["meta_info"]
    assert m["finish_reason"]["type"] == "abort" and 0 < m["completion_tokens"] < 240
    assert len(m["output_token_logprobs"]) == len(ra["output_ids"]) == m["completion_tokens"]
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in rs)
    assert after["meta_info"]["completion_tokens"] >= 1


def test_pause_in_place_keeps_requests_and_abort_mode_aborts(engine_url):
    async def go():
        async with EngineClient(engine_url, timeout=60) as c:
            kept = asyncio.create_task(c.generate(input_ids=[5, 6], sampling_params=LONG))
            await wait_running(c)
            await c.pause_generation("in_place")
            await assert_held(c, kept)
            await c.continue_generation()
            r_kept = await kept
            gone = asyncio.create_task(c.generate(input_ids=[5, 6], sampling_params=LONG))
            await wait_running(c)
            await c.pause_generation("abort")
            r_gone = await gone
            waiting = asyncio.create_task(c.generate(input_ids=[7], sampling_params={"max_new_tokens": 2}))
            await assert_held(c, waiting, waiting=1)
            await c.continue_generation()
            return r_kept, r_gone, await waiting

    r_kept, r_gone, r_wait = run(go())
    assert r_kept["meta_info"]["finish_reason"]["type"] == "length"
    assert r_gone["meta_info"]["finish_reason"]["type"] == "abort"
    assert r_wait["meta_info"]["completion_tokens"] >= 1


def test_stop_token_ids_and_stop_strings(engine_url, engine_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(engine_model))
    p = [20, 21, 22, 23]

    async def go():
        async with EngineClient(engine_url, timeout=60) as c:
            base = await c.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 30,
                                                                  "ignore_eos": True})
            ids = base["output_ids"]
            stop_id = next(t for t in ids[2:] if t >= 7)  # a plain character, not a special token
            first = ids.index(stop_id)
            by_id = await c.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 30,
                                                                   "ignore_eos": True, "stop_token_ids": [stop_id]})
            stop_str = tok.decode([stop_id])
            by_str = await c.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 30,
                                                                    "ignore_eos": True, "stop": [stop_str]})
            no_trim = await c.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 30,
                                                                     "ignore_eos": True, "stop": stop_str,
                                                                     "no_stop_trim": True})
            return ids, first, stop_id, stop_str, by_id, by_str, no_trim

    ids, first, stop_id, stop_str, by_id, by_str, no_trim = run(go())
    assert by_id["output_ids"] == ids[:first + 1]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert by_id["text"] == tok.decode(ids[:first], skip_special_tokens=True)
    assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
    assert by_str["output_ids"] == ids[:first + 1] and not by_str["text"].endswith(stop_str)
    assert no_trim["text"].endswith(stop_str)


def test_text_prompt_eos_and_text_in_logprobs(engine_url, engine_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(engine_model))
    text = tok.apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True, tokenize=False)

    async def go():
        async with EngineClient(engine_url, timeout=60) as c:
            return await c.request("POST", "/generate", {
                "text": text, "return_logprob": True, "return_text_in_logprobs": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 8}})

    r = run(go())
    assert r["meta_info"]["prompt_tokens"] == len(tok(text)["input_ids"])
    assert [x[2] for x in r["meta_info"]["output_token_logprobs"]] == [tok.decode([t]) for t in r["output_ids"]]


def test_bad_input_gets_400_naming_the_field_and_server_keeps_serving(engine_url):
    async def go():
        out = []
        async with aiohttp.ClientSession() as s:
            async with s.post(engine_url + "/generate", data=b"{not json") as r:
                out.append((r.status, (await r.json())["error"]["message"]))
            for body in ({"input_ids": list(range(1, 60)) * 5}, {"text": "hi", "sampling_params": {"top_k": "x"}},
                         {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
                         {"input_ids": [100000]}, {"sampling_params": {}}):
                async with s.post(engine_url + "/generate", json=body) as r:
                    out.append((r.status, (await r.json())["error"]["message"]))
            async with s.post(engine_url + "/pause_generation", json={"mode": "sideways"}) as r:
                out.append((r.status, (await r.json())["error"]["message"]))
        async with EngineClient(engine_url, timeout=30) as c:
            ok = await c.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})
        return out, ok

    out, ok = run(go())
    fields = ["body", "input_ids", "sampling_params.top_k", "sampling_params.max_new_tokens", "input_ids",
              "text/input_ids", "mode"]
    assert [s for s, _ in out] == [400] * len(fields)
    for (_, msg), f in zip(out, fields):
        assert msg.startswith(f), (msg, f)
    assert ok["meta_info"]["completion_tokens"] >= 1


def test_client_disconnect_frees_its_slot(engine_url):
    async def load(c):
        return (await c.request("GET", "/get_load"))[0]["num_reqs"]

    async def go():
        async with EngineClient(engine_url, timeout=30) as c:
            await c.pause_generation("in_place")  # the request waits, so only the disconnect can free it
            try:
                with pytest.raises(EngineError):
                    await c.generate(input_ids=[5, 6], sampling_params=LONG, timeout=0.5)
                deadline = time.monotonic() + 5
                while await load(c) != 0:
                    assert time.monotonic() < deadline, "the disconnected request still holds its slot"
                    await asyncio.sleep(0.02)
            finally:
                await c.continue_generation()

    run(go())


def test_info_endpoints(engine_url, engine_model):
    from transformers import AutoTokenizer

    async def go():
        async with EngineClient(engine_url, timeout=30) as c:
            return (await c.health(), await c.health_generate(), await c.model_info(), await c.server_info(),
                    await c.request("GET", "/get_model_info"), await c.request("GET", "/get_server_info"),
                    await c.get_weight_version(), await c.flush_cache(), await c.request("GET", "/v1/models"))

    health, hgen, mi, si, mi2, si2, wv, flushed, models = run(go())
    assert health and hgen and wv == mi["weight_version"] and "flushed" in flushed
    assert mi == mi2 and mi["is_generation"] and mi["model_path"] == str(engine_model.resolve())
    assert AutoTokenizer.from_pretrained(mi["model_path"]).vocab_size > 0
    assert si["model_path"] == mi["model_path"] and si2["port"] == si["port"] and si["context_length"] == 256
    assert models["data"][0]["max_model_len"] == 256
    json.dumps(si)


def test_release_and_resume_memory_occupation(engine_url):
    async def go():
        async with EngineClient(engine_url, timeout=60) as c:
            busy = asyncio.create_task(c.generate(input_ids=[5, 6], sampling_params=LONG))
            await wait_running(c)
            with pytest.raises(EngineError) as e_busy:  # SGLang needs an idle engine
                await c.request("POST", "/release_memory_occupation", {})
            await c.abort_request(abort_all=True)
            await busy
            with pytest.raises(EngineError) as e_tag:
                await c.request("POST", "/release_memory_occupation", {"tags": ["gpu"]})
            assert (await c.request("POST", "/release_memory_occupation", {}))["success"]
            held = asyncio.create_task(c.generate(input_ids=[7], sampling_params={"max_new_tokens": 2}))
            await assert_held(c, held, waiting=1)  # released: paused until resumed
            assert (await c.request("POST", "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]}))["success"]
            return e_busy.value, e_tag.value, await held

    e_busy, e_tag, held = run(go())
    assert e_busy.status == 400 and "in flight" in e_busy.body
    assert e_tag.status == 400 and "tags" in e_tag.body
    assert held["meta_info"]["completion_tokens"] >= 1


def test_client_disconnect_aborts_a_running_request(engine_url):
    async def state(c):
        s = (await c.server_info())["internal_states"][0]
        return s["decode_steps"], s["num_reqs"]

    async def go():
        async with EngineClient(engine_url, timeout=30) as c:
            steps0, _ = await state(c)
            with pytest.raises(EngineError):  # the client gives up while the request decodes
                # 0.05 s: a faster decode finishes the 240 tokens in ~0.15 s on the toy model
                await c.generate(input_ids=[5, 6], sampling_params=LONG, timeout=0.05)
            deadline = time.monotonic() + 10
            while (await state(c))[1] != 0:
                assert time.monotonic() < deadline, "the disconnected request kept running"
                await asyncio.sleep(0.01)
            return (await state(c))[0] - steps0

    steps = run(go())
    assert steps < 239  # it stopped before its 240 tokens


def test_prompt_only_request_scores_every_prompt_token_as_sglang_does(engine_url, engine_model):
    """``max_new_tokens: 0`` with ``return_logprob`` and ``logprob_start_len`` (how a teacher scores
    a student's sample, slime's on-policy distillation): no token is generated, and
    ``input_token_logprobs`` holds ``[None, ids[k]]`` then ``[log p(ids[t] | ids[:t]), ids[t]]`` for
    every later t, equal to a full forward (raw logits, temperature 1 whatever the request's, as
    SGLang); a generating request gets the same prompt log-probs beside its output ones."""
    ps = prompts(4)

    async def go():
        async with EngineClient(engine_url, timeout=60) as c:
            scored = [await c.request("POST", "/generate", {
                "input_ids": p, "return_logprob": True, "logprob_start_len": k,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0.7}}) for p, k in zip(ps, (0, 1, 0, 2))]
            batch = await c.request("POST", "/generate", {
                "input_ids": ps, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0}})
            both = await c.request("POST", "/generate", {
                "input_ids": ps[0], "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
            default = await c.generate(input_ids=ps[0], sampling_params={"max_new_tokens": 0})
            bad = []
            for body in ({"logprob_start_len": len(ps[0]) + 1}, {"logprob_start_len": -2},
                         {"sampling_params": {"max_new_tokens": -1}}):
                try:
                    await c.request("POST", "/generate", {"input_ids": ps[0], "return_logprob": True, **body})
                except EngineError as e:
                    bad.append(str(e))
            return scored, batch, both, default, bad

    scored, batch, both, default, bad = run(go())
    model = hf_model(engine_model)
    for p, k, out in zip(ps, (0, 1, 0, 2), scored):
        assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        lps = out["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in lps] == p[k:] and lps[0][0] is None
        ref = reference_logprobs(model, p[:k + 1], p[k + 1:], 1.0)
        assert max(abs(a - b) for (a, _, _), b in zip(lps[1:], ref)) <= 1e-5
    assert [o["meta_info"]["input_token_logprobs"] for o in batch] == [
        [[None, p[0], None]] + [[x[0], x[1], None] for x in o["meta_info"]["input_token_logprobs"][1:]]
        for p, o in zip(ps, batch)]
    assert batch[0]["meta_info"]["input_token_logprobs"] == scored[0]["meta_info"]["input_token_logprobs"]
    assert both["meta_info"]["input_token_logprobs"] == scored[0]["meta_info"]["input_token_logprobs"]
    assert len(both["output_ids"]) == 3
    assert default["meta_info"]["input_token_logprobs"] == []  # SGLang's -1: no prompt log-probs
    assert len(bad) == 3 and "logprob_start_len" in bad[0] and "logprob_start_len" in bad[1] \
        and "max_new_tokens" in bad[2]
