"""bench/rollout: is the rollout path ever the bottleneck?

(a) Client throughput against a server that answers at once, in its own process, 512 requests in
    flight: our client (``EngineClient`` on aiohttp + orjson), plain aiohttp, and httpx. Two
    servers: a minimal asyncio HTTP server (the client is the bottleneck: what we measure) and
    ``embedded_engine.instant`` (aiohttp's server: the realistic case; on 2 cores the
    server and the client share them). Target: >= 3000 requests/s on a 2-core machine.
(b) The whole manager (router, rewards, grouping) against calling the same engines directly with
    the same concurrency, on the toy model with the embedded engine, greedy so both do the same
    work. ``ratio`` = direct time / manager time (medians), target 0.95. The manager runs with group
    requests (the default: a prompt's samples in one batch /generate) and with per-sample requests,
    interleaved with the baselines (per-sample requests straight to the engines, the issue's
    baseline; and batch requests per group straight to the engines, like for like). Also the CPU each path uses
    (router, this process, engines; from /proc), and what that predicts: on a box whose cores the
    engines keep busy, every CPU ms spent beside the engines costs ~1/cores ms of batch time.
(c) The router alone: its CPU per request and the latency it adds, in front of 2 instant engines,
    for requests like the manager's; for the router as we start it and for variants of its flags
    and environment (``ROUTER_VARIANTS``). bench/NOTES.md "## rollout" reads these numbers.

    unshare -n bash -c 'ip link set lo up && exec python bench/rollout.py'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from sglang_protocol.client import EngineClient, new_session  # noqa: E402
from sglang_protocol.net import free_port  # noqa: E402

PAYLOAD = {"input_ids": list(range(5, 25)), "sampling_params": {"max_new_tokens": 4, "temperature": 1.0},
           "return_logprob": True}


async def _drive(send, total: int, inflight: int) -> tuple[float, float]:
    """Send ``total`` requests with ``inflight`` workers. Returns (requests/s, requests per second of
    client CPU time): the second is what the client could sustain on one core of its own, the
    first is what it got while sharing the machine with the server."""
    counter = iter(range(total))

    async def worker():
        for _ in counter:
            await send()
    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(inflight)))
    return total / (time.perf_counter() - t0), total / (time.process_time() - c0)


async def client_throughput(url: str, total: int, inflight: int) -> dict[str, float]:
    import aiohttp
    import httpx

    out: dict[str, float] = {}
    async with EngineClient(url, timeout=60) as c:
        async def ours():
            r = await c.generate(input_ids=PAYLOAD["input_ids"], sampling_params=PAYLOAD["sampling_params"])
            assert len(r["output_ids"]) == 4
        await _drive(ours, 500, inflight)  # warm-up: connections opened
        out["ours"], out["ours_per_client_cpu_s"] = await _drive(ours, total, inflight)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def raw():
            async with s.post(url + "/generate", json=PAYLOAD) as r:
                await r.json()
        await _drive(raw, 500, inflight)
        out["aiohttp_json"], out["aiohttp_json_per_client_cpu_s"] = await _drive(raw, total, inflight)
    limits = httpx.Limits(max_connections=inflight, max_keepalive_connections=inflight)
    async with httpx.AsyncClient(limits=limits, timeout=60) as h:
        async def hx():
            (await h.post(url + "/generate", json=PAYLOAD)).json()
        await _drive(hx, 64, 64)
        # httpx manages a few dozen requests/s at this concurrency: one round of `inflight` is enough
        out["httpx"], out["httpx_per_client_cpu_s"] = await _drive(hx, inflight, inflight)
    return out


_ANSWER = json.dumps({"text": "", "output_ids": [10] * 4, "meta_info": {
    "id": "x", "finish_reason": {"type": "stop", "matched": 10}, "prompt_tokens": 20, "completion_tokens": 4,
    "weight_version": "0", "output_token_logprobs": [[-0.5, 10, None]] * 4}}).encode()


class _FastHTTP(asyncio.Protocol):
    """A minimal keep-alive HTTP/1.1 server that answers every request with the same /generate
    answer: far cheaper per request than any Python web framework, so the client is what is
    measured. (The instant engine, on aiohttp's server, is measured too: the realistic case.)"""

    def connection_made(self, transport):
        self.t, self.buf = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            length = 0
            for line in self.buf[:head_end].lower().split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line[15:])
            if len(self.buf) < head_end + 4 + length:
                return
            self.buf = self.buf[head_end + 4 + length:]
            self.t.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(_ANSWER)).encode() + b"\r\n\r\n" + _ANSWER)


def serve_fast(port: int) -> None:
    async def run():
        server = await asyncio.get_running_loop().create_server(_FastHTTP, "127.0.0.1", port, backlog=4096)
        await server.serve_forever()
    asyncio.run(run())


def part_a(model: Path, total: int, inflight: int, repeats: int, fast: bool) -> dict[str, float]:
    port = free_port()
    cmd = ([sys.executable, __file__, "--serve-fast", str(port)] if fast else
           [sys.executable, "-m", "embedded_engine.instant", "--port", str(port), "--model-path", str(model)])
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"

        async def wait_up():
            async with EngineClient(url) as c:
                for _ in range(200):
                    try:
                        await c.generate(input_ids=[1], sampling_params={"max_new_tokens": 4}, timeout=1)
                        return
                    except Exception:  # noqa: BLE001 - not up yet
                        await asyncio.sleep(0.05)
            raise RuntimeError("instant engine did not start")
        asyncio.run(wait_up())
        runs = [asyncio.run(client_throughput(url, total, inflight)) for _ in range(repeats)]
    finally:
        proc.terminate()
        proc.wait(10)
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


async def _direct(clients: list[EngineClient], prompts: list[list[int]], n: int, params: dict,
                  concurrency: int) -> float:
    """The baseline: the same requests (same sampling params) straight to the engines, round-robin,
    same concurrency."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, ids: list[int]):
        async with sem:
            r = await clients[i % len(clients)].generate(input_ids=ids, sampling_params=params)
            return len(r["output_ids"])
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, ids) for i, ids in enumerate(p for p in prompts for _ in range(n))))
    return time.perf_counter() - t0


async def _direct_batch(clients: list[EngineClient], prompts: list[list[int]], n: int, params: dict,
                        concurrency: int) -> float:
    """The like-for-like baseline of group requests: each prompt's ``n`` samples as one batch request
    straight to the engines, round-robin, the same concurrency counted in samples."""
    from rollout_manager.generate import SampleSlots

    slots = SampleSlots(concurrency)

    async def one(i: int, ids: list[int]):
        await slots.acquire_many(n)
        try:
            rs = await clients[i % len(clients)].generate_batch([ids] * n, sampling_params=params)
        finally:
            slots.release_many(n)
        return sum(len(r["output_ids"]) for r in rs)
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return time.perf_counter() - t0


# part (b)'s paths, run in turn within each repeat (rotated, so none always runs first): the manager
# with group requests (the default) and with per-sample requests, and the baselines without it
B_PATHS = ("manager_group", "manager_sample", "direct", "direct_batch", "via_router")


async def part_b(model: Path, engines: int, batch: int, n: int, max_len: int, repeats: int,
                 dispatch: str = "router", engine_urls: list[str] | None = None,
                 per_engine: int = 64) -> dict[str, float]:
    """``engine_urls``: servers already running (e.g. real SGLang, ``bench/rollout_sglang.py``) instead
    of ``engines`` embedded engines started here; ``per_engine``: requests in flight per engine."""
    from _fixtures_rollout import make_args, toy_argv

    from rollout_manager.generate import sampling_params
    from rollout_manager.manager import RolloutManager

    where = ["--engine-urls", *engine_urls] if engine_urls else ["--rollout-num-engines", str(engines)]
    engines = len(engine_urls) if engine_urls else engines
    args, settings = make_args(toy_argv(model, *where, "--n-samples-per-prompt", str(n),
                                        "--rollout-batch-size", str(batch), "--rollout-max-response-len", str(max_len),
                                        "--rollout-temperature", "0", "--sglang-server-concurrency", str(per_engine),
                                        "--rollout-dispatch", dispatch))
    m = RolloutManager(settings, args, log_dir=tempfile.mkdtemp(prefix="bench-rollout-"))
    await m.start()
    concurrency = settings.sampling.sglang_server_concurrency * engines
    params = sampling_params(settings)  # exactly what the manager sends
    times: dict[str, list[float]] = {p: [] for p in B_PATHS}
    tokens, prompt_lens, requests = [], [], {p: [] for p in ("manager_group", "manager_sample")}
    # CPU seconds per path (where the time goes): the router, this process (the manager, or the bare
    # client of the baselines), the engines
    engine_pids = [e.process.pid for e in m.fleet.engines if e.process is not None]
    cpu: dict[str, list[float]] = {f"{who}_{path}": [] for who in ("router", "self", "engines") for path in B_PATHS}

    def cpu_now() -> tuple[float, float, float]:
        return m.router.cpu_seconds() or 0.0, time.process_time(), sum(_pid_cpu_s(p) for p in engine_pids)

    def cpu_add(path: str, before: tuple[float, float, float]) -> None:
        for who, b, a in zip(("router", "self", "engines"), before, cpu_now()):
            cpu[f"{who}_{path}"].append(a - b)
    session = new_session()  # the baseline's connections are pooled and warm too
    clients = [EngineClient(u, timeout=600, session=session) for u in m.engine_urls]
    router = [EngineClient(m.router_url, timeout=600, session=session)]  # diagnostic: the router's share
    try:
        for granularity in ("group", "sample"):  # warm-up: engines' first forward passes, connections
            settings.sampling.rollout_request_granularity = granularity
            groups, _ = await m.generate(-1)
        warm = [g[0].tokens[:g[0].prompt_length] for g in groups]
        await _direct(clients, warm, n, params, concurrency)
        await _direct_batch(clients, warm, n, params, concurrency)
        for k in range(repeats):
            state = m.data_source.state_dict()  # peek at the prompts of the manager's next step
            prompts = [g[0].tokens for g in m.data_source.get_samples(batch)]

            def manager_step(granularity: str):
                async def run():
                    m.data_source.load_state_dict(state)  # both modes take the same prompts
                    settings.sampling.rollout_request_granularity = granularity
                    c = cpu_now()
                    groups, metrics = await m.generate(k)
                    cpu_add(f"manager_{granularity}", c)
                    assert sorted(g[0].tokens[:g[0].prompt_length] for g in groups) == sorted(prompts)  # same work
                    times[f"manager_{granularity}"].append(metrics["rollout/time_s"])
                    requests[f"manager_{granularity}"].append(metrics["rollout/requests"])
                    tokens.append(metrics["rollout/response_len_mean"])
                    prompt_lens.extend(g[0].prompt_length for g in groups)
                return run

            def baseline(path: str, fn, targets: list[EngineClient]):
                async def run():
                    c = cpu_now()
                    times[path].append(await fn(targets, prompts, n, params, concurrency))
                    cpu_add(path, c)
                return run
            order = [manager_step("group"), manager_step("sample"), baseline("direct", _direct, clients),
                     baseline("direct_batch", _direct_batch, clients), baseline("via_router", _direct, router)]
            r = k % len(order)
            for run in order[r:] + order[:r]:  # rotate: no path always runs first
                await run()
    finally:
        await session.close()
        await m.shutdown()
    return {**{f"{p}_s": statistics.median(v) for p, v in times.items()},
            **{f"{p}_runs_s": v for p, v in times.items()},
            "response_len_mean": statistics.mean(tokens), "prompt_len_mean": statistics.mean(prompt_lens),
            "samples": batch * n, **{f"requests_{p}": statistics.median(v) for p, v in requests.items()},
            "last_prompts": prompts, "sampling_params": params,  # for an offline run of the same work
            **{f"cpu_ms_{k}": 1e3 * statistics.median(v) for k, v in cpu.items()}}


def _pid_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far, from /proc (0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def cpu_model(r: dict[str, float], cores: int, path: str) -> dict[str, float]:
    """What the CPU the engines do not use costs, if the engines keep every core busy: each extra
    second of CPU on the manager ``path`` (router + manager process) over the bare client's costs
    1/cores seconds of batch time. Returns that extra CPU (ms) and the ratio it predicts."""
    extra_ms = (r[f"cpu_ms_router_{path}"] + r[f"cpu_ms_self_{path}"]) - r["cpu_ms_self_direct"]
    predicted = r["direct_s"] / (r["direct_s"] + extra_ms / 1e3 / cores)
    return {"extra_cpu_ms": extra_ms, "predicted_ratio": predicted}


# part (c): the router variants measured; each is (extra router flags, extra environment)
ROUTER_VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "ours": ([], {}),  # rollout_manager/router.py as it is
    "log_info": (["--log-level", "info"], {}),  # the router's own default log level
    "tokio_1_thread": ([], {"TOKIO_WORKER_THREADS": "1"}),
    "no_retries_no_cb": (["--disable-retries", "--disable-circuit-breaker"], {}),
    "all_three_off": (["--disable-retries", "--disable-circuit-breaker"], {"TOKIO_WORKER_THREADS": "1"}),
}


async def _router_cost_once(router_url: str, engine_urls: list[str], ids: list[int], params: dict, total: int,
                            inflight: int, cpu_s) -> dict[str, float]:
    session = new_session()
    via = EngineClient(router_url, timeout=60, session=session)
    direct = [EngineClient(u, timeout=60, session=session) for u in engine_urls]
    turn = iter(range(1 << 62))

    async def send_via():
        await via.generate(input_ids=ids, sampling_params=params)

    async def send_direct():
        await direct[next(turn) % len(direct)].generate(input_ids=ids, sampling_params=params)

    async def latency(send, n: int) -> float:
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            await send()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)
    try:
        await _drive(send_via, 200, inflight)  # warm-up: connections opened on both hops
        await _drive(send_direct, 200, inflight)
        c0 = cpu_s()
        await _drive(send_via, total, inflight)
        cpu_us = (cpu_s() - c0) / total * 1e6
        lat_via, lat_direct = await latency(send_via, 300), await latency(send_direct, 300)
    finally:
        await session.close()
    return {"cpu_us_per_request": cpu_us, "added_latency_ms": (lat_via - lat_direct) * 1e3,
            "latency_direct_ms": lat_direct * 1e3}


def part_c(model: Path, prompt_len: int, max_len: int, total: int, inflight: int, repeats: int
           ) -> dict[str, dict[str, float]]:
    """The router's cost per request, alone: its CPU time per request (from /proc) at ``inflight``
    requests in flight, and the latency it adds to one request (median, one at a time), in front of
    2 instant engines answering ``max_len`` tokens with log-probs (the answer size of part b), for
    requests like the manager's (``prompt_len`` input ids, the manager's sampling params). The
    variants run in turn, ``repeats`` rounds, so load changes on the box hit them alike."""
    from rollout_manager.router import Router

    ids = list(range(5, 5 + prompt_len))
    params = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_len, "stop": [],
              "stop_token_ids": [], "skip_special_tokens": False, "no_stop_trim": True}
    procs, urls = [], []
    for _ in range(2):
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "embedded_engine.instant", "--port", str(port),
                                       "--model-path", str(model), "--num-tokens", str(max_len)], cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in ROUTER_VARIANTS}
    try:
        from embedded_engine.launch import wait_healthy
        for u in urls:
            wait_healthy(u, 60, None)
        for _ in range(repeats):
            for name, (extra, env) in ROUTER_VARIANTS.items():
                router = Router.start(policy="round_robin", health_check_interval=2.0, extra_args=extra, env=env,
                                      log_path=Path(tempfile.mkdtemp(prefix="bench-router-")) / "router.log")
                try:
                    async def one():
                        for u in urls:
                            await router.add_worker(u)
                        return await _router_cost_once(router.url, urls, ids, params, total, inflight,
                                                       router.cpu_seconds)
                    runs[name].append(asyncio.run(one()))
                finally:
                    router.stop()
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    return {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--total", type=int, default=8000, help="(a) requests per measurement")
    ap.add_argument("--inflight", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--b-repeats", type=int, default=9)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--c-total", type=int, default=3000, help="(c) requests per router-cost measurement")
    ap.add_argument("--c-repeats", type=int, default=3)
    ap.add_argument("--parts", default="abc", help="which parts to run (b always runs; a and c are optional)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "rollout.json"))
    ap.add_argument("--serve-fast", type=int, default=None, help=argparse.SUPPRESS)  # internal: the ceiling server
    a = ap.parse_args()
    if a.serve_fast is not None:
        serve_fast(a.serve_fast)
        return
    from scripts import make_toy_model

    load_before = os.getloadavg()[0]  # other work on the box moves these numbers a lot: record it
    model = make_toy_model.main(["--out", tempfile.mkdtemp(prefix="bench-toy-") + "/model"])
    ra = part_a(model, a.total, a.inflight, a.repeats, fast=True) if "a" in a.parts else {}
    ra_engine = part_a(model, a.total, a.inflight, a.repeats, fast=False) if "a" in a.parts else {}
    rb = asyncio.run(part_b(model, a.engines, a.batch, a.n, a.max_len, a.b_repeats))
    rd = asyncio.run(part_b(model, a.engines, a.batch, a.n, a.max_len, a.b_repeats, dispatch="direct"))
    rc = part_c(model, round(rb["prompt_len_mean"]), a.max_len, a.c_total, a.engines * 64, a.c_repeats) \
        if "c" in a.parts else {}
    cores = os.cpu_count() or 1
    # ratio = direct / manager (medians): the issue's baseline is per-sample requests straight to the engines;
    # "vs batch": against the same groups sent as batch requests straight to the engines (like for like)
    ratios = {f"{d}_{g}": r["direct_s"] / r[f"manager_{g}_s"] for d, r in (("router", rb), ("direct", rd))
              for g in ("group", "sample")}
    ratio_vs_batch = {f"{d}_group": r["direct_batch_s"] / r["manager_group_s"]
                      for d, r in (("router", rb), ("direct", rd))}
    # the same ratios paired per repeat (both paths of a repeat ran the same prompts), then the median
    paired = {f"{d}_{g}": statistics.median(x / y for x, y in zip(r["direct_runs_s"], r[f"manager_{g}_runs_s"]))
              for d, r in (("router", rb), ("direct", rd)) for g in ("group", "sample")}
    models = {f"{d}_{g}": cpu_model(r, cores, f"manager_{g}") for d, r in (("router", rb), ("direct", rd))
              for g in ("group", "sample")}
    if ra:
        print(f"\n(a) client throughput, {a.inflight} in flight (median of {a.repeats})")
        print(f"{'client':<30}{'fast server':>12}{'instant engine':>16}   requests/s")
        for k, v in ra.items():
            print(f"{k:<30}{v:>12.0f}{ra_engine[k]:>16.0f}")
        print(f"target >= 3000 requests/s: ours {ra['ours']:.0f} ({ra['ours'] / 3000:.2f}x); per second of client "
              f"CPU {ra['ours_per_client_cpu_s']:.0f} ({ra['ours_per_client_cpu_s'] / 3000:.2f}x)")
    samples = rb["samples"]
    for d, r in (("router", rb), ("direct", rd)):
        print(f"\n(b) --rollout-dispatch {d}: {samples} samples ({a.batch} groups of {a.n}), {a.engines} embedded "
              f"engines, greedy, max {a.max_len} tokens (median of {a.b_repeats}; each path's runs in []) ")
        print(f"{'path':<30}{'seconds':>9}{'router':>9}{'self':>9}{'engines':>9}  CPU ms   runs")
        labels = {"manager_group": "manager, group requests", "manager_sample": "manager, per-sample requests",
                  "direct": "direct, per sample", "direct_batch": "direct, batch per group",
                  "via_router": "direct+router, per sample"}
        for p in B_PATHS:
            runs = " ".join(f"{x:.3f}" for x in r[f"{p}_runs_s"])
            print(f"{labels[p]:<30}{r[f'{p}_s']:>9.3f}{r[f'cpu_ms_router_{p}']:>9.1f}{r[f'cpu_ms_self_{p}']:>9.1f}"
                  f"{r[f'cpu_ms_engines_{p}']:>9.1f}  [{runs}]")
        for g in ("group", "sample"):
            mo = models[f"{d}_{g}"]
            print(f"ratio direct/manager ({g} requests) = {ratios[f'{d}_{g}']:.3f} (paired per repeat "
                  f"{paired[f'{d}_{g}']:.3f}; target >= 0.95); extra CPU "
                  f"{mo['extra_cpu_ms']:.1f} ms predicts {mo['predicted_ratio']:.3f}")
        print(f"ratio direct batch/manager (group requests) = {ratio_vs_batch[f'{d}_group']:.3f}; requests per step: "
              f"group {r['requests_manager_group']:.0f}, sample {r['requests_manager_sample']:.0f}")
    if rc:
        print(f"\n(c) the router alone, 2 instant engines, {round(rb['prompt_len_mean'])} input ids, {a.max_len}-token "
              f"answers, {a.engines * 64} in flight (median of {a.c_repeats})")
        print(f"{'variant':<20}{'CPU us/request':>16}{'added latency ms':>18}")
        for name, r in rc.items():
            print(f"{name:<20}{r['cpu_us_per_request']:>16.0f}{r['added_latency_ms']:>18.3f}")
    metrics: dict = {}
    if ra:
        metrics.update({**{f"a_client_rps_{k}": round(v, 1) for k, v in ra.items()},
                        **{f"a_instant_engine_rps_{k}": round(v, 1) for k, v in ra_engine.items()},
                        "a_target_rps": 3000, "a_ratio_ours_over_target": round(ra["ours"] / 3000, 3),
                        "a_ratio_ours_client_cpu_over_target": round(ra["ours_per_client_cpu_s"] / 3000, 3),
                        "a_ratio_ours_over_aiohttp_json": round(ra["ours"] / ra["aiohttp_json"], 3)})
    for d, r in (("router", rb), ("direct", rd)):
        pre = "b_" if d == "router" else "b_dispatch_direct_"
        metrics.update({f"{pre}{p}_s": round(r[f"{p}_s"], 4) for p in B_PATHS})
        metrics.update({f"{pre}{p}_runs_s": [round(x, 4) for x in r[f"{p}_runs_s"]] for p in B_PATHS})
        metrics.update({f"{pre}{k}": round(v, 1) for k, v in r.items() if k.startswith("cpu_ms_")})
        for g in ("group", "sample"):
            metrics[f"{pre}ratio_{g}"] = round(ratios[f"{d}_{g}"], 4)
            metrics[f"{pre}ratio_{g}_paired"] = round(paired[f"{d}_{g}"], 4)
            metrics[f"{pre}extra_cpu_ms_{g}"] = round(models[f"{d}_{g}"]["extra_cpu_ms"], 1)
            metrics[f"{pre}cpu_model_predicted_ratio_{g}"] = round(models[f"{d}_{g}"]["predicted_ratio"], 4)
            metrics[f"{pre}requests_{g}"] = r[f"requests_manager_{g}"]
        metrics[f"{pre}ratio_group_vs_direct_batch"] = round(ratio_vs_batch[f"{d}_group"], 4)
    metrics.update({
        # the headline numbers under their earlier names: the default (group requests) now
        "b_ratio_router_dispatch": round(ratios["router_group"], 4),
        "b_ratio_direct_dispatch": round(ratios["direct_group"], 4),
        "b_ratio_router_dispatch_per_sample_requests": round(ratios["router_sample"], 4),
        "b_router_cpu_us_per_sample_group": round(rb["cpu_ms_router_manager_group"] / samples * 1e3, 1),
        "b_router_cpu_us_per_sample_sample": round(rb["cpu_ms_router_manager_sample"] / samples * 1e3, 1),
        "b_max_len": a.max_len, "b_samples": samples, "b_groups": a.batch, "b_n": a.n,
        "b_response_len_mean": round(rb["response_len_mean"], 2), "b_prompt_len_mean": round(rb["prompt_len_mean"], 2),
        "load_avg_1min_before": round(load_before, 2), "load_avg_1min_after": round(os.getloadavg()[0], 2),
        **{f"c_{name}_{k}": round(v, 3) for name, r in rc.items() for k, v in r.items()}})
    result = {
        "name": "rollout", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {os.cpu_count()} cores {platform.processor() or platform.machine()}",
        "command": "unshare -n bash -c 'ip link set lo up && exec python bench/rollout.py'",
        "metrics": metrics,
        # the headline is the stricter of the two baselines: the issue's (per-sample requests straight
        # to the engines) and like for like (the same batch requests straight to the engines)
        "ratio": round(min(ratios["router_group"], ratio_vs_batch["router_group"]), 4),
        "target": 0.95,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
