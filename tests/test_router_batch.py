"""What sglang-router 0.3.2 does with SGLang's *batch* form of ``/generate`` (issue 4, group requests).

Step 1 of sending a group as one request: does the real router forward a batch body to one worker
and pass the worker's list answer back intact? Pinned here against a tiny aiohttp worker that
records what it receives and answers one dict per element:

- ``input_ids`` as a list of lists with ``rid`` absent, or with ``rid`` a single string: forwarded
  to one worker (the string rid unchanged), the list answer comes back intact and in order.
- ``rid`` as a list of strings (one per element, SGLang's other batch form): HTTP 422 from the
  router itself ("rid: invalid type: sequence, expected a string"); nothing reaches the worker.
- ``text`` as a list, ``sampling_params`` as a list, ``return_logprob`` as a list: 422 likewise.

SGLang expands a string rid of a batch to per-element rids ``f"{rid}_{i}"`` (io_struct.py
``GenerateReqInput._normalize_rid``), so a group request through this router must use that form
(or no rid) to keep per-sample aborts. If a newer router accepts rid lists, the 422 test fails:
then the list form can be used. Needs loopback sockets: run inside ``unshare -n`` as CI does.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from rollout_manager.router import Router
from sglang_protocol.net import free_port

pytest.importorskip("sglang_router")


async def _echo_worker(received: list) -> tuple[web.AppRunner, str]:
    """A worker that records each /generate body and answers one dict per batch element."""
    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        received.append(body)
        ids = body["input_ids"]
        if ids and isinstance(ids[0], list):
            return web.json_response([{"text": f"e{i}", "output_ids": x,
                                       "meta_info": {"finish_reason": {"type": "length"},
                                                     "output_token_logprobs": [[-0.5, t, None] for t in x]}}
                                      for i, x in enumerate(ids)])
        return web.json_response({"text": "one", "output_ids": ids, "meta_info": {"id": body.get("rid")}})

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "echo", "is_generation": True})

    app = web.Application()
    app.router.add_post("/generate", generate)
    for p in ("/health", "/health_generate"):
        app.router.add_get(p, ok)
    for p in ("/get_model_info", "/model_info", "/get_server_info", "/server_info"):
        app.router.add_get(p, info)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def test_router_batch_forms(tmp_path):
    received: list = []

    async def go() -> None:
        runner, url = await _echo_worker(received)
        router = Router.start(policy="round_robin", health_check_interval=1.0, log_path=tmp_path / "router.log",
                              timeout=30)
        try:
            await router.add_worker(url)
            async with aiohttp.ClientSession() as s:
                async def post(body: dict) -> tuple[int, str | list]:
                    received.clear()
                    async with s.post(router.url + "/generate", json=body) as r:
                        return r.status, (await r.json() if r.status == 200 else await r.text())

                ids = [[1, 2, 3], [4, 5], [6]]
                sp = {"max_new_tokens": 4, "temperature": 0.0}
                # forwarded: rid a string (SGLang expands it to rid_0, rid_1, ...) or absent
                for rid in ("grp", None):
                    body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True}
                    if rid is not None:
                        body["rid"] = rid
                    status, out = await post(body)
                    assert status == 200, out
                    assert len(received) == 1  # one request reached one worker
                    assert received[0]["input_ids"] == ids and received[0]["sampling_params"] == sp
                    assert received[0].get("rid") == rid
                    assert [o["output_ids"] for o in out] == ids  # the list answer, intact and in order
                    assert [o["text"] for o in out] == ["e0", "e1", "e2"]
                # rejected by the router itself (422), nothing reaches the worker
                for bad, field in (({"rid": ["a", "b", "c"]}, "rid"), ({"text": ["x", "y"]}, "text"),
                                   ({"sampling_params": [sp, sp, sp]}, "sampling_params"),
                                   ({"return_logprob": [True] * 3}, "return_logprob")):
                    body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True, **bad}
                    if "text" in bad:
                        del body["input_ids"]
                    status, out = await post(body)
                    assert status == 422 and field in out and "invalid type" in out, (bad, status, out)
                    assert received == []
        finally:
            router.stop()
            await runner.cleanup()

    asyncio.run(go())
