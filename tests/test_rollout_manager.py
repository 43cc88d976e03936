"""The manager end to end through the real sglang-router, against instant engines (real processes,
real HTTP, no model): grouping, token in/out, over-sampling + filter, partial rollout across a
weight update, engine death mid-rollout (retry, no loss, no duplicates, restart)."""

from __future__ import annotations

import asyncio
import time

import pytest

from _fixtures_rollout import push_during_pause, running_manager, toy_argv, wait_inflight

from buffer.sample import Status, check_group
from sglang_protocol.client import EngineClient

INSTANT = ["--rollout-engine", "instant", "--rollout-num-engines", "2", "--health-check-interval", "0.5"]


@pytest.mark.parametrize("dispatch,granularity", [("router", "group"), ("direct", "group"), ("router", "sample"),
                                                  ("direct", "sample")])
def test_groups_token_in_token_out(toy_model_dir, dispatch, granularity):
    async def go():
        argv = toy_argv(toy_model_dir, *INSTANT, "--n-samples-per-prompt", "4", "--rollout-batch-size", "8",
                        "--rollout-max-response-len", "16", "--rollout-dispatch", dispatch,
                        "--rollout-request-granularity", granularity)
        async with running_manager(argv) as m:
            assert len(m.engine_urls) == 2
            groups, metrics = await m.generate(0)
            prompts = {r.prompt: r.input_ids for r in m.data_source.records}
            return groups, metrics, prompts, dict(m._dispatcher.inflight)
    groups, metrics, prompts, inflight = asyncio.run(go())
    if dispatch == "direct":  # both engines were used, and every request was accounted for
        assert len(inflight) == 2 and all(v == 0 for v in inflight.values())
    # per-engine throughput: each engine's samples of this step over the step's time, together all 32
    rates = [metrics[f"rollout/engine_{i}_samples_per_s"] for i in (0, 1)]
    assert sum(rates) * metrics["rollout/time_s"] == pytest.approx(32) and metrics["rollout/num_engines"] == 2
    if dispatch == "direct":
        assert all(r > 0 for r in rates)
    assert len(groups) == 8
    for g in groups:
        check_group(g, 4)
        assert len({s.group_index for s in g}) == 1
        for s in g:
            assert s.tokens == prompts[s.prompt] + [10] * 4  # the prompt ids sent, the output ids appended
            assert s.rollout_log_probs == [-0.5] * 4 and s.loss_mask == [1] * 4
            assert s.weight_versions == [0] and s.status == Status.COMPLETED and s.reward == 0.0
    assert len({s.index for g in groups for s in g}) == 32
    assert metrics["rollout/num_samples"] == 32 and metrics["rollout/response_len_mean"] == 4
    # one request per group (its 4 samples in one batch /generate), or one per sample
    assert metrics["rollout/requests"] == (8 if granularity == "group" else 32) and metrics["rollout/retries"] == 0
    assert metrics["rollout/truncated_frac"] == 0 and metrics["rollout/reward_mean"] == 0
    # each request's time as the manager saw it, split into the engine's own (meta_info e2e_latency)
    # and the way there and back (the router's hop included with dispatch="router")
    seen, engine, outside = (metrics[f"rollout/{k}"] for k in ("request_time_s", "engine_time_s",
                                                                "request_outside_engine_s"))
    assert 0 < engine < seen < metrics["rollout/time_s"] and outside > 0


def test_over_sampling_with_dynamic_filter(toy_model_dir):
    async def go():
        argv = toy_argv(toy_model_dir, *INSTANT, "--n-samples-per-prompt", "2", "--rollout-batch-size", "4",
                        "--over-sampling-batch-size", "8", "--custom-rm-path", "_fixtures_rollout.parity_rm",
                        "--dynamic-sampling-filter-path", "plugins.filters.check_reward_nonzero_std")
        async with running_manager(argv) as m:
            groups, metrics = await m.generate(0)
            return groups, metrics, m.data_source
    groups, metrics, ds = asyncio.run(go())
    assert len(groups) == 4
    assert all(g[0].group_index % 2 == 0 for g in groups)  # odd groups have equal rewards: filtered
    assert metrics["rollout/dropped_groups"] >= 3
    assert metrics["rollout/reward_mean"] == 0.5
    # every prompt started is accounted for: kept, dropped, or back in the data source
    started = ds.next_group_index
    assert started == len(groups) + metrics["rollout/dropped_groups"] + ds.num_returned


def test_wind_down_returns_unfinished_groups_partial(toy_model_dir):
    async def go():
        argv = toy_argv(toy_model_dir, *INSTANT,
                        "--engine-extra-args", "--delay 0.02 --delay-jitter 1.5 --num-tokens 8",
                        "--n-samples-per-prompt", "2", "--rollout-batch-size", "2", "--over-sampling-batch-size", "8",
                        "--partial-rollout")
        async with running_manager(argv) as m:
            first, m1 = await m.generate(0)
            returned = [[s.copy(tokens=list(s.tokens), weight_versions=list(s.weight_versions)) for s in g]
                        for g in m.data_source._returned]  # snapshot: step 1 resumes these very samples
            second, m2 = await m.generate(1)
            return first, m1, returned, second, m.data_source
    first, m1, returned, second, ds = asyncio.run(go())
    assert len(first) == 2 and m1["rollout/returned_groups"] == len(returned) >= 1
    assert m1["rollout/aborted_requests"] >= 1
    partial = [s for g in returned for s in g if s.status == Status.PENDING and s.response_length > 0]
    assert partial, "aborted samples keep the tokens generated so far"
    for s in partial:
        assert s.response_length == 4 and s.tokens[-4:] == [10] * 4 and s.weight_versions == [0]
    assert len(second) == 2 and all(s.status in (Status.COMPLETED, Status.TRUNCATED) for g in second for s in g)
    kept_ids = {g[0].group_index for g in first + second}
    assert len(kept_ids) == 4  # no group kept twice


def test_partial_rollout_across_weight_update(toy_model_dir):
    async def go(mask: bool):
        extra = ["--mask-offpolicy-in-partial-rollout"] if mask else []
        argv = toy_argv(toy_model_dir, *INSTANT, "--engine-extra-args", "--delay 1.0 --num-tokens 8",
                        "--n-samples-per-prompt", "2", "--rollout-batch-size", "3", "--rollout-max-response-len", "8",
                        "--partial-rollout", *extra)
        async with running_manager(argv) as m:
            task = asyncio.ensure_future(m.generate(0))
            await wait_inflight(m, 6)
            await push_during_pause(m)
            return await asyncio.wait_for(task, 30)
    for mask in (False, True):
        groups, metrics = asyncio.run(go(mask))
        assert metrics["rollout/aborted_requests"] == 6
        for s in (s for g in groups for s in g):
            assert s.weight_versions == [0, 1] and s.response_length == 8 and len(s.rollout_log_probs) == 8
            assert s.loss_mask == ([0] * 4 + [1] * 4 if mask else [1] * 8)


@pytest.mark.parametrize("dispatch,granularity", [("router", "group"), ("direct", "group"), ("router", "sample")])
def test_engine_killed_mid_rollout_no_loss_no_duplicates(toy_model_dir, dispatch, granularity):
    """Group requests on the dead engine are retried whole on the other (per-sample ones alone)."""
    async def go():
        argv = toy_argv(toy_model_dir, *INSTANT, "--engine-extra-args", "--delay 0.6", "--rollout-dispatch", dispatch,
                        "--n-samples-per-prompt", "4", "--rollout-batch-size", "16",
                        "--rollout-request-granularity", granularity)
        async with running_manager(argv) as m:
            task = asyncio.ensure_future(m.generate(0))
            await wait_inflight(m, 64)  # about half of them on engine 0
            m.fleet.kill(0)
            groups, metrics = await asyncio.wait_for(task, 60)
            deadline = time.monotonic() + 30
            while "engine 0 restarted" not in m.fleet.events and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            workers = await m.router.list_workers()
            again, _ = await m.generate(1)
            return groups, metrics, list(m.fleet.events), workers, again
    groups, metrics, events, workers, again = asyncio.run(go())
    samples = [s for g in groups for s in g]
    assert len(samples) == 64 and len({s.index for s in samples}) == 64
    assert all(s.status == Status.COMPLETED and s.response_length == 4 for s in samples)
    assert metrics["rollout/retries"] >= 1 and metrics["rollout/failed_frac"] == 0
    assert events[:2] == ["engine 0 removed", "engine 0 restarted"]
    assert len(workers) == 2 and all(w["is_healthy"] for w in workers)
    assert len(again) == 16


def test_evaluate(toy_model_dir):
    async def go():
        argv = toy_argv(toy_model_dir, *INSTANT, "--eval-prompt-data", str(toy_model_dir / "data" / "eval.jsonl"),
                        "--n-samples-per-eval-prompt", "2", "--rm-type", "exact_match")
        async with running_manager(argv) as m:
            return await m.evaluate(0)
    metrics = asyncio.run(go())
    assert metrics["eval/num_groups"] == 64 and metrics["eval/num_samples"] == 128
    assert metrics["eval/accuracy"] == 0.0 and "eval/tokens_per_s" in metrics


def test_hung_engine_is_replaced(toy_model_dir):
    import os
    import signal

    async def go():
        argv = toy_argv(toy_model_dir, *INSTANT, "--engine-extra-args", "--delay 0.3", "--health-check-timeout", "1",
                        "--n-samples-per-prompt", "4", "--rollout-batch-size", "8")
        async with running_manager(argv) as m:
            task = asyncio.ensure_future(m.generate(0))
            await wait_inflight(m, 32)
            os.kill(m.fleet.engines[0].process.pid, signal.SIGSTOP)  # alive but not answering
            groups, metrics = await asyncio.wait_for(task, 60)
            for _ in range(300):  # up to 30 s for the replacement to come up
                if "engine 0 restarted" in m.fleet.events:
                    break
                await asyncio.sleep(0.1)
            return groups, metrics, list(m.fleet.events), m.fleet.engines[0].restarts
    groups, metrics, events, restarts = asyncio.run(go())
    samples = [s for g in groups for s in g]
    assert len({s.index for s in samples}) == 32 and all(s.status == Status.COMPLETED for s in samples)
    assert events[:2] == ["engine 0 removed", "engine 0 restarted"] and restarts == 1


def test_running_router_and_engine_urls(toy_model_dir, tmp_path):
    import subprocess
    import sys

    from rollout_manager.router import Router
    from sglang_protocol.net import free_port

    ports = [free_port(), free_port()]
    procs = [subprocess.Popen([sys.executable, "-m", "embedded_engine.instant", "--port", str(p),
                               "--model-path", str(toy_model_dir)]) for p in ports]
    port = free_port()
    with open(tmp_path / "router.log", "wb") as log:  # a router the user runs: no control-plane keys
        proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                 "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
                                 str(free_port()), "--policy", "round_robin"], stdout=log, stderr=subprocess.STDOUT)
    router = Router("127.0.0.1", port, proc)  # a handle to read its workers and stop it
    router._wait_up(60)

    async def go():
        argv = toy_argv(toy_model_dir, "--engine-urls", *[f"127.0.0.1:{p}" for p in ports],
                        "--sglang-router-ip", router.host, "--sglang-router-port", str(router.port),
                        "--n-samples-per-prompt", "2", "--rollout-batch-size", "4")
        async with running_manager(argv) as m:
            groups, _ = await m.generate(0)
            workers = await router.list_workers()
            return groups, workers, m.args
    try:
        groups, workers, args = asyncio.run(go())
    finally:
        router.stop()
        for p in procs:
            p.terminate()
            p.wait(10)
    assert len(groups) == 4
    assert sorted(w["url"] for w in workers) == sorted(f"http://127.0.0.1:{p}" for p in ports)
    assert (args.sglang_router_ip, args.sglang_router_port) == (router.host, router.port)


def test_custom_rollout_function_slime_style(toy_model_dir):
    async def go():
        argv = toy_argv(toy_model_dir, *INSTANT, "--rollout-function-path", "_fixtures_rollout.wrapped_rollout",
                        "--n-samples-per-prompt", "2", "--rollout-batch-size", "3")
        async with running_manager(argv) as m:
            return await m.generate(7)
    groups, metrics = asyncio.run(go())
    assert len(groups) == 3 and all(s.metadata["wrapped"] == 7 for g in groups for s in g)
    assert metrics["rollout/num_samples"] == 6 and metrics["rollout/reward_mean"] == 0.0


def test_engine_side_pause_like_weight_sync(toy_model_dir):
    """weight_sync pauses the engines itself (abort mode): requests resume, each segment tagged."""
    async def go():
        argv = toy_argv(toy_model_dir, *INSTANT, "--engine-extra-args", "--delay 1.0 --num-tokens 8",
                        "--n-samples-per-prompt", "2", "--rollout-batch-size", "2", "--rollout-max-response-len", "8",
                        "--partial-rollout")
        async with running_manager(argv) as m:
            task = asyncio.ensure_future(m.generate(0))
            await wait_inflight(m, 4)
            clients = [EngineClient(u, timeout=10) for u in m.engine_urls]
            await asyncio.gather(*(c.pause_generation("abort") for c in clients))
            await asyncio.sleep(0.5)  # the retried requests wait in the paused engines
            await asyncio.gather(*(c.update_weights_from_disk("unused", weight_version="1") for c in clients))
            await asyncio.gather(*(c.continue_generation() for c in clients))
            for c in clients:
                await c.close()
            return await asyncio.wait_for(task, 30)
    groups, metrics = asyncio.run(go())
    assert metrics["rollout/aborted_requests"] == 4 and metrics["rollout/failed_frac"] == 0
    for s in (s for g in groups for s in g):
        assert s.weight_versions == [0, 1] and s.response_length == 8 and s.loss_mask == [1] * 8


def test_custom_generate_errors_fail_only_their_samples(toy_model_dir):
    async def go():
        argv = toy_argv(toy_model_dir, *INSTANT, "--custom-generate-function-path",
                        "_fixtures_rollout.half_broken_generate", "--n-samples-per-prompt", "2",
                        "--rollout-batch-size", "3")
        async with running_manager(argv) as m:
            return await m.generate(0)
    groups, metrics = asyncio.run(go())
    for g in groups:
        ok, bad = g[0], g[1]  # indices are even, odd
        assert ok.status == Status.COMPLETED and ok.response_length == 4
        assert bad.status == Status.FAILED and bad.metadata["failure_reason"] == "generate: RuntimeError"
        assert bad.response_length == 0 and bad.loss_mask == [] and bad.tokens == ok.tokens[:ok.prompt_length]
    assert metrics["rollout/failures/generate: RuntimeError"] == 3 and metrics["rollout/failed_frac"] == 0.5
