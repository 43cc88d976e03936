"""An SGLang-API server with no model that answers at once: the ceiling for the client path.

It speaks the same HTTP subset as the engines (``/generate``, ``/abort_request``, pause/continue,
health and info routes), so the real sglang-router registers it, and the rollout client cannot
tell it from an engine. ``bench/rollout.py`` uses it to measure client throughput, and the
tests use it to exercise routing, retries and aborts at full speed. It is not a model: each
``/generate`` returns ``--num-tokens`` copies of ``--token-id`` (fewer if ``max_new_tokens`` is
smaller) after ``--delay`` seconds (plus up to ``--delay-jitter``), with log-prob -0.5 per token;
its ``text`` is empty unless the answer is given as ``--output-text`` (then a ``text`` prompt's
length is reported too).
SGLang's batch form (``input_ids`` a list of lists) answers a list, each element abortable by
its own rid (``f"{rid}_{i}"``). An aborted request returns half of its tokens with finish reason
``abort`` (as if interrupted midway), so partial rollouts can be exercised;
``/update_weights_from_disk`` only sets the reported ``weight_version``.

    python -m embedded_engine.instant --port 30001 --model-path DIR [--delay 0.01]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from aiohttp import web

from sglang_protocol.client import batch_rids
from sglang_protocol.net import dumps_bytes, loads


class InstantEngine:
    """The request handlers; ``paused`` requests wait, ``abort_all`` ends the waiting ones."""

    def __init__(self, model_path: str, token_id: int, num_tokens: int, delay: float, weight_version: str,
                 delay_jitter: float = 0.0, output_ids: list[int] | None = None, output_text: str | None = None):
        self.model_path, self.token_id, self.num_tokens, self.delay = model_path, token_id, num_tokens, delay
        self.delay_jitter = delay_jitter
        self.output_ids = output_ids  # a fixed answer instead of num_tokens copies of token_id
        self.output_text = ""  # the answer's text: only --output-text sets it (no tokenizer otherwise)
        self.tokenizer = None
        if output_text is not None:  # for plugins that read the answer's text (slime's search-r1)
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.output_text = output_text
            self.output_ids = self.tokenizer(output_text, add_special_tokens=False)["input_ids"]
        self.weight_version = weight_version
        self.running = asyncio.Event()
        self.running.set()
        self.inflight: dict[str, asyncio.Event] = {}
        self.count = 0
        self.finished = 0  # requests answered (aborted ones too), as the embedded engine's finished_reqs

    @staticmethod
    def _json(obj: object) -> web.Response:
        return web.Response(body=dumps_bytes(obj), content_type="application/json")

    async def generate(self, request: web.Request) -> web.Response:
        """One prompt, or SGLang's batch form (``input_ids`` list of lists, ``rid`` a string expanded
        to ``f"{rid}_{i}"`` or a list, ``sampling_params``/``return_logprob`` shared or lists): a
        batch answers a list in order, each element abortable by its own rid."""
        body = loads(await request.read())
        ids = body.get("input_ids")
        if not (isinstance(ids, list) and ids and isinstance(ids[0], list)):
            if ids is None and isinstance(body.get("text"), str) and self.tokenizer is not None:
                ids = self.tokenizer(body["text"])["input_ids"]  # a text prompt: its length is reported
            return self._json(await self._one(body.get("rid"), ids or [], body.get("sampling_params") or {},
                                              bool(body.get("return_logprob"))))
        n, rid = len(ids), body.get("rid")
        rids = rid if isinstance(rid, list) else batch_rids(rid, n) if rid else [None] * n

        def each(name: str) -> list:
            v = body.get(name)
            return v if isinstance(v, list) else [v] * n
        outs = await asyncio.gather(*(self._one(r, x, sp or {}, bool(lp)) for r, x, sp, lp in
                                      zip(rids, ids, each("sampling_params"), each("return_logprob"))))
        return self._json(list(outs))

    async def _one(self, rid: str | None, input_ids: list[int], sp: dict, return_logprob: bool) -> dict:
        full = len(self.output_ids) if self.output_ids is not None else self.num_tokens
        n = min(full, sp.get("max_new_tokens", full))
        rid = rid or f"r{self.count}"
        self.count += 1
        arrival = time.monotonic()
        aborted = asyncio.Event()
        self.inflight[rid] = aborted
        try:
            delay = self.delay + (random.random() * self.delay_jitter if self.delay_jitter else 0.0)
            if delay or not self.running.is_set():
                await self.running.wait()
                if delay:
                    try:
                        await asyncio.wait_for(aborted.wait(), delay)
                    except asyncio.TimeoutError:
                        pass
        finally:
            self.inflight.pop(rid, None)
            self.finished += 1
        if aborted.is_set():  # an aborted request reports what it generated so far: half here
            n, finish = n // 2, {"type": "abort", "message": "aborted"}
        elif n < full:
            finish = {"type": "length", "length": n}
        else:
            finish = {"type": "stop", "matched": self.token_id}
        ids = list(self.output_ids[:n]) if self.output_ids is not None else [self.token_id] * n
        n = len(ids)
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(input_ids),
                "completion_tokens": n, "weight_version": self.weight_version,
                "e2e_latency": time.monotonic() - arrival,  # SGLang's: arrival to finish, inside the server
                "output_token_logprobs": [[-0.5, t, None] for t in ids] if return_logprob else []}
        text = self.output_text if n == full else ""
        return {"text": text, "output_ids": ids, "meta_info": meta}

    async def abort_request(self, request: web.Request) -> web.Response:
        body = loads(await request.read() or b"{}")
        targets = list(self.inflight) if body.get("abort_all") else [body.get("rid")]
        for rid in targets:
            if rid in self.inflight:
                self.inflight[rid].set()
        return self._json({"success": True})

    async def pause(self, request: web.Request) -> web.Response:
        self.running.clear()
        for ev in self.inflight.values():
            ev.set()
        return self._json({"success": True})

    async def resume(self, request: web.Request) -> web.Response:
        self.running.set()
        return self._json({"success": True})

    async def ok(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def model_info(self, request: web.Request) -> web.Response:
        return self._json({"model_path": self.model_path, "tokenizer_path": self.model_path,
                           "is_generation": True, "weight_version": self.weight_version})

    async def server_info(self, request: web.Request) -> web.Response:
        return self._json({"model_path": self.model_path, "tokenizer_path": self.model_path, "dp_size": 1,
                           "tp_size": 1, "weight_version": self.weight_version,
                           "internal_states": [{"finished_reqs": self.finished}]})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = loads(await request.read())
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return self._json({"success": True, "message": "weight version set (no weights here)"})


def build_app(engine: InstantEngine) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.add_routes([
        web.post("/generate", engine.generate), web.post("/abort_request", engine.abort_request),
        web.post("/pause_generation", engine.pause), web.post("/continue_generation", engine.resume),
        web.get("/health", engine.ok), web.get("/health_generate", engine.ok),
        web.post("/flush_cache", engine.ok), web.get("/flush_cache", engine.ok),
        web.get("/model_info", engine.model_info), web.get("/get_model_info", engine.model_info),
        web.get("/server_info", engine.server_info), web.get("/get_server_info", engine.server_info),
        web.post("/update_weights_from_disk", engine.update_weights_from_disk),
    ])
    return app


def build_parser() -> argparse.ArgumentParser:
    """The instant engine's flags (no abbreviations: a prefix of a flag is an error, not that flag)."""
    ap = argparse.ArgumentParser(prog="python -m embedded_engine.instant", allow_abbrev=False,
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-path", required=True, help="reported to the router (it loads the tokenizer)")
    ap.add_argument("--token-id", type=int, default=10)
    ap.add_argument("--num-tokens", type=int, default=4)
    ap.add_argument("--delay", type=float, default=0.0, help="seconds before answering")
    ap.add_argument("--delay-jitter", type=float, default=0.0, help="extra random delay, uniform in [0, this)")
    ap.add_argument("--output-ids", default=None, help="comma-separated ids to answer instead (overrides "
                    "--token-id/--num-tokens)")
    ap.add_argument("--output-text", default=None, help="a fixed answer given as text, tokenized with the "
                    "model's tokenizer (overrides --output-ids) and returned as the answer's text too")
    ap.add_argument("--weight-version", default="0")
    return ap


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    engine = InstantEngine(a.model_path, a.token_id, a.num_tokens, a.delay, a.weight_version, a.delay_jitter,
                           [int(x) for x in a.output_ids.split(",")] if a.output_ids else None, a.output_text)
    web.run_app(build_app(engine), host=a.host, port=a.port, access_log=None, print=None, backlog=4096)


if __name__ == "__main__":
    main()
