"""Group requests (``--rollout-request-granularity group``, the default): which samples share a
request, the in-flight limit counted in samples, ``generate_group`` against fake engines (retry of a
whole group on another engine, per-element aborts, partial-rollout budgets, rejected requests), and
``EngineClient.generate_batch``'s contract. The end-to-end runs through the real router are in
tests/test_rollout_group_e2e.py."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from _fixtures_rollout import make_args

from buffer.sample import Sample, Status
from sglang_protocol.client import EngineClient, EngineError, batch_rids
from rollout_manager.generate import SampleSlots, generate, generate_group, split_requests
from rollout_manager.plugin_api import RolloutContext, StepState, set_context, set_step

PROMPT = [1, 2, 3]
PARAMS = {"temperature": 1.0, "max_new_tokens": 6}


def _sample(i: int, generated: int = 0) -> Sample:
    s = Sample(group_index=0, index=i, prompt="p", tokens=PROMPT + [7] * generated, response_length=generated,
               loss_mask=[1] * generated, rollout_log_probs=[-0.5] * generated,
               weight_versions=[0] if generated else [])
    s.metadata["prompt_length"] = len(PROMPT)
    return s


class FakeEngine:
    """Answers 3 tokens (fewer if the budget is smaller); fails ``fail`` times first; aborts the
    elements at the positions in ``abort_once`` after 1 token, once each; answers HTTP ``status`` if set."""

    def __init__(self, url: str, fail: int = 0, abort_once: set[int] | None = None, status: int | None = None):
        self.base_url, self.fail, self.abort_once, self.status = url, fail, set(abort_once or ()), status
        self.calls: list[tuple[list[list[int]], dict, str]] = []

    def _answer(self, ids: list[int], sp: dict, element: int) -> dict:
        n = min(3, sp["max_new_tokens"])
        finish = {"type": "length"} if n == sp["max_new_tokens"] else {"type": "stop", "matched": 0}
        if element in self.abort_once:
            self.abort_once.discard(element)
            n, finish = 1, {"type": "abort"}
        return {"text": "", "output_ids": [7] * n,
                "meta_info": {"finish_reason": finish, "weight_version": "0",
                              "output_token_logprobs": [[-0.5, 7, None]] * n}}

    async def generate_batch(self, input_ids, sampling_params, return_logprob, rid, timeout):
        assert return_logprob and isinstance(rid, str) and len(input_ids) > 1
        return self._call(input_ids, sampling_params, rid)

    async def generate(self, input_ids, sampling_params, return_logprob, rid, timeout):
        return self._call([input_ids], sampling_params, rid)[0]

    def _call(self, input_ids, sp, rid):
        self.calls.append(([list(x) for x in input_ids], dict(sp), rid))
        if self.status is not None:
            raise EngineError(self.base_url, self.status, "bad request")
        if self.fail:
            self.fail -= 1
            raise EngineError(self.base_url, None, "ClientConnectorError: refused")
        return [self._answer(ids, sp, i) for i, ids in enumerate(input_ids)]


class FakeDispatcher:
    def __init__(self, engines: list[FakeEngine]):
        self.engines = engines
        self.inflight = {e.base_url: 0 for e in engines}

    def pick(self, avoid):
        live = [e for e in self.engines if e.base_url not in avoid] or self.engines
        e = min(live, key=lambda x: self.inflight[x.base_url])
        return e.base_url, e

    def started(self, url, samples=1):
        self.inflight[url] += samples

    def finished(self, url, samples=1):
        self.inflight[url] -= samples


def _run_group(engines: list[FakeEngine], samples: list[Sample], *flags: str, capacity: int = 64):
    _, settings = make_args(["--hf-checkpoint", "/m", "--rollout-max-response-len", "6", *flags])

    async def go():
        disp = FakeDispatcher(engines)
        ctx = RolloutContext(settings=settings, args=argparse.Namespace(), client=None, dispatcher=disp,
                             engine_urls=lambda: [e.base_url for e in engines], semaphore=SampleSlots(capacity),
                             rewarder=None, generate_fn=generate, filter_fn=None, loop=asyncio.get_running_loop())
        ctx.running.set()
        set_context(ctx)
        step = StepState()
        set_step(step)
        out = await asyncio.wait_for(generate_group(argparse.Namespace(), samples, dict(PARAMS)), 30)
        assert all(v == 0 for v in disp.inflight.values()) and ctx.semaphore._value == capacity
        return out, step
    return asyncio.run(go())


def test_split_requests_by_params_seed_and_limit():
    fresh = [_sample(i) for i in range(4)]
    [(p, batch)] = split_requests(fresh, PARAMS, limit=64)
    assert batch == fresh and p == PARAMS
    mixed = [_sample(0), _sample(1, 2), _sample(2), _sample(3, 2)]
    parts = split_requests(mixed, PARAMS, limit=64)
    assert [(p["max_new_tokens"], [s.index for s in b]) for p, b in parts] == [(6, [0, 2]), (4, [1, 3])]
    assert [len(b) for _, b in split_requests(fresh, PARAMS, limit=3)] == [3, 1]
    seeded = split_requests(fresh, {**PARAMS, "sampling_seed": 5}, limit=64)
    assert [len(b) for _, b in seeded] == [1, 1, 1, 1]  # a seeded sample never shares a request


def test_sample_slots_take_k_at_once_without_deadlock():
    async def go():
        slots = SampleSlots(4)
        held, peak = [0], [0]

        async def group(k: int):
            await slots.acquire_many(k)
            held[0] += k
            peak[0] = max(peak[0], held[0])
            await asyncio.sleep(0.01)
            held[0] -= k
            slots.release_many(k)

        async def single():
            async with slots:
                await asyncio.sleep(0.005)
        await asyncio.wait_for(asyncio.gather(*(group(3) for _ in range(6)), *(single() for _ in range(6))), 5)
        with pytest.raises(ValueError):
            await slots.acquire_many(5)
        return peak[0], slots._value
    peak, value = asyncio.run(go())
    assert peak <= 4 and value == 4


def test_one_request_per_group_and_segments_appended():
    samples = [_sample(i) for i in range(4)]
    eng = FakeEngine("http://a")
    out, step = _run_group([eng], samples)
    assert out is samples and len(eng.calls) == 1
    ids, sp, rid = eng.calls[0]
    assert ids == [PROMPT] * 4 and sp == PARAMS and len(rid) == 32
    assert step.stats.requests == 1 and step.stats.generated_tokens == 12 and not step.inflight
    for s in samples:
        assert s.status == Status.COMPLETED and s.tokens == PROMPT + [7] * 3 and s.weight_versions == [0]
        assert s.loss_mask == [1] * 3 and s.rollout_log_probs == [-0.5] * 3


def test_failed_group_is_retried_whole_on_another_engine():
    samples = [_sample(i) for i in range(4)]
    bad, good = FakeEngine("http://a", fail=1), FakeEngine("http://b")
    out, step = _run_group([bad, good], samples)
    assert len(bad.calls) == 1 and len(good.calls) == 1 and good.calls[0][0] == [PROMPT] * 4
    assert step.stats.retries == 1 and step.stats.requests == 2
    assert all(s.status == Status.COMPLETED and s.response_length == 3 for s in samples)  # once each


def test_aborted_element_resumes_alone_with_its_budget():
    samples = [_sample(i) for i in range(4)]
    eng = FakeEngine("http://a", abort_once={2})
    out, step = _run_group([eng], samples, "--partial-rollout")
    assert len(eng.calls) == 2
    ids, sp, _ = eng.calls[1]
    assert ids == [PROMPT + [7]] and sp["max_new_tokens"] == 5  # only the aborted sample, from its 1 token
    assert step.stats.aborted_requests == 1
    assert [s.response_length for s in samples] == [3, 3, 4, 3] and samples[2].weight_versions == [0, 0]


def test_resumed_group_with_different_budgets_splits_by_budget():
    samples = [_sample(0), _sample(1, 2), _sample(2, 5), _sample(3, 6)]
    eng = FakeEngine("http://a")
    _run_group([eng], samples, "--partial-rollout")
    assert sorted((len(ids), sp["max_new_tokens"]) for ids, sp, _ in eng.calls) == [(1, 1), (1, 4), (1, 6)]
    assert [s.status for s in samples] == [Status.COMPLETED, Status.COMPLETED, Status.TRUNCATED, Status.TRUNCATED]
    assert [s.response_length for s in samples] == [3, 5, 6, 6]


def test_rejected_group_fails_every_sample_once():
    samples = [_sample(i) for i in range(3)]
    eng = FakeEngine("http://a", status=400)
    _run_group([eng], samples)
    assert len(eng.calls) == 1
    assert all(s.status == Status.FAILED and s.metadata["failure_reason"] == "engine: HTTP 400" for s in samples)


def test_group_larger_than_the_limit_is_split():
    samples = [_sample(i) for i in range(5)]
    eng = FakeEngine("http://a")
    _run_group([eng], samples, capacity=2)
    assert sorted(len(ids) for ids, _, _ in eng.calls) == [1, 2, 2]


def test_generate_batch_contract(unused_port_server):
    url, received = unused_port_server

    async def go():
        async with EngineClient(url, timeout=10) as c:
            ok = await c.generate_batch([[1, 2], [3]], sampling_params={"max_new_tokens": 2}, rid="g")
            errors = []
            for mode in ("short", "dict"):
                with pytest.raises(EngineError) as e:
                    await c.generate_batch([[1, 2], [3]], sampling_params={}, rid=mode)
                errors.append(str(e.value))
            with pytest.raises(ValueError):
                await c.generate_batch([])
            return ok, errors
    ok, errors = asyncio.run(go())
    # what goes on the wire: the form sglang-router 0.3.2 forwards (tests/test_router_batch.py)
    assert received[0] == {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2},
                           "return_logprob": True, "rid": "g"}
    assert [o["meta_info"]["id"] for o in ok] == batch_rids("g", 2) == ["g_0", "g_1"]
    assert "a batch of 2 prompts was answered with a list of 1" in errors[0]
    assert "answered with dict" in errors[1]


@pytest.fixture
def unused_port_server():
    """An in-process aiohttp /generate that records bodies; rid "short"/"dict" answer malformed."""
    import threading

    from aiohttp import web

    from sglang_protocol.net import free_port

    received: list = []

    async def handler(request):
        body = await request.json()
        received.append(body)
        one = [{"text": "", "output_ids": [9], "meta_info": {"id": f"{body['rid']}_{i}"}}
               for i in range(len(body["input_ids"]))]
        if body["rid"] == "short":
            return web.json_response(one[:1])
        if body["rid"] == "dict":
            return web.json_response(one[0])
        return web.json_response(one)

    port = free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()

    async def serve():
        app = web.Application()
        app.router.add_post("/generate", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        started.set()
        return runner

    t = threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True)
    t.start()
    assert started.wait(10)
    yield f"http://127.0.0.1:{port}", received
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)
