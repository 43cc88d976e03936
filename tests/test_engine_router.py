"""Two embedded engines behind the real sglang-router: registration (the router reads /health,
/server_info, /model_info and loads the tokenizer from the reported model_path), requests
spread over both, a worker removed and re-added at run time.

Needs loopback sockets: run inside ``unshare -n`` as CI does (see _fixtures_engine)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import sys
import time

import pytest

from _fixtures_engine import engine_model, run, start_engine, stop_process  # noqa: F401
from sglang_protocol.net import free_port
from sglang_protocol.client import EngineClient

pytest.importorskip("sglang_router")


@pytest.fixture(scope="module")
def router_and_engines(engine_model, tmp_path_factory):
    procs = []
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as ex:  # start both engines at once
            procs += list(ex.map(lambda _: start_engine(engine_model), range(2)))
        port = free_port()
        log = open(tmp_path_factory.mktemp("router") / "router.log", "wb")
        router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                   "--port", str(port), "--prometheus-host", "127.0.0.1",
                                   "--prometheus-port", str(free_port()), "--policy", "round_robin"],
                                  stdout=log, stderr=subprocess.STDOUT)
        procs.append((router, f"http://127.0.0.1:{port}"))
        yield f"http://127.0.0.1:{port}", [u for _, u in procs[:2]]
    finally:
        for p, _ in procs:
            stop_process(p)


async def served(url: str) -> int:
    async with EngineClient(url, timeout=10) as c:
        return (await c.server_info())["internal_states"][0]["finished_reqs"]


async def wait_workers(c: EngineClient, urls: set[str], timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        ws = (await c.request("GET", "/workers"))["workers"]
        if {w["url"] for w in ws if w["is_healthy"]} == urls and len(ws) == len(urls):
            return ws
        assert time.monotonic() < deadline, f"router workers never became {urls}: {ws}"
        await asyncio.sleep(0.2)


def test_router_spreads_requests_and_workers_change_at_run_time(router_and_engines, engine_model):
    router, (u1, u2) = router_and_engines

    async def burst(c: EngineClient, n: int) -> list[dict]:
        return await asyncio.gather(*[c.generate(text="1+2=", sampling_params={"max_new_tokens": 3, "ignore_eos": True})
                                      for _ in range(n)])

    async def go():
        async with EngineClient(router, timeout=60) as c:
            deadline = time.monotonic() + 30
            while not await c.health(timeout=2):
                assert time.monotonic() < deadline, "router did not start"
                await asyncio.sleep(0.2)
            for u in (u1, u2):
                assert (await c.request("POST", "/workers", {"url": u}))["status"] == "accepted"
            ws = await wait_workers(c, {u1, u2})
            base = [await served(u1), await served(u2)]
            rs = await burst(c, 12)
            mid = [await served(u1), await served(u2)]
            w1 = next(w for w in ws if w["url"] == u1)
            await c.request("DELETE", f"/workers/{w1['id']}")
            await wait_workers(c, {u2})
            rs += await burst(c, 6)
            end = [await served(u1), await served(u2)]
            await c.request("POST", "/workers", {"url": u1})
            ws = await wait_workers(c, {u1, u2})
            rs += await burst(c, 6)
            final = [await served(u1), await served(u2)]
            return ws, rs, base, mid, end, final

    ws, rs, base, mid, end, final = run(go(), timeout=180)
    assert all(r["meta_info"]["completion_tokens"] == 3 for r in rs) and len(rs) == 24
    assert all(w["metadata"].get("model_path") == str(engine_model.resolve()) for w in ws), ws
    d1, d2 = mid[0] - base[0], mid[1] - base[1]
    assert d1 + d2 == 12 and d1 > 0 and d2 > 0  # spread over both engines
    assert end[0] == mid[0] and end[1] - mid[1] == 6  # the removed worker gets nothing
    assert final[0] > end[0]  # the re-added worker serves again
