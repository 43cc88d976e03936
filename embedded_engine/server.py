"""The HTTP server: SGLang's native API on aiohttp, in front of the scheduler thread.

Handlers never run torch work on the event loop: generation goes through the scheduler
thread, weight collectives through their group's worker thread. Bad input gets HTTP 400 with
the offending field named, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from sglang_protocol.buckets import parse_dtype
from sglang_protocol.net import dumps, loads
from sglang_protocol.tensor_update import parse_request

from .access import check_master_address, check_weights_dir, split_list
from .auth import auth_middleware
from .lora import LoraAdapters, LoraError, decode_tensors
from .model_runner import ModelRunner
from .protocol import GenerateInput, ProtocolError, parse_generate_request
from .scheduler import Request, Scheduler
from .settings import EngineSettings
from .weights import WeightManager, WeightUpdateError

log = logging.getLogger(__name__)
VERSION = "reservoir-embedded-engine 0.1"


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=dumps)


def _bad(message: str, status: int = 400) -> web.Response:
    # SGLang's error body for /generate; weight endpoints use {"success", "message"} instead
    return _json({"error": {"message": message, "code": status}}, status)


class Engine:
    """Model runner + scheduler + weight manager, and the aiohttp handlers over them."""

    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.runner = ModelRunner(settings)
        self.scheduler = Scheduler(self.runner, settings.max_running_requests, settings.max_prefill_tokens,
                                   settings.random_seed, settings.weight_version)
        self.weights = WeightManager(self.runner, self.scheduler, settings.weight_update_timeout_s,
                                     settings.weight_loaders())
        self.lora = LoraAdapters(self.weights._params, self.scheduler, settings.enable_lora, settings.max_lora_rank,
                                 settings.lora_modules())
        self.model_path = settings.model_path
        self.started = time.time()

    def close(self) -> None:
        self.scheduler.stop()
        self.weights.close()

    # --- app ----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30,
                              middlewares=[auth_middleware(self.settings.api_key, self.settings.admin_api_key)])
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        for path, h in (("/flush_cache", self.flush_cache), ("/health", self.health),
                        ("/health_generate", self.health_generate), ("/model_info", self.model_info),
                        ("/get_model_info", self.model_info), ("/server_info", self.server_info),
                        ("/get_server_info", self.server_info), ("/get_load", self.get_load),
                        ("/weights_checksum", self.weights_checksum), ("/weights_info", self.weights_info)):
            r.add_get(path, h)
            r.add_post(path, h)
        r.add_post("/init_weights_update_group", self._weights(self.init_weights_update_group))
        r.add_post("/begin_weight_update", self._weights(self.begin_weight_update))
        r.add_post("/end_weight_update", self._weights(self.end_weight_update))
        r.add_post("/update_weights_from_distributed", self._weights(self.update_weights_from_distributed))
        r.add_post("/update_weights_from_tensor", self._weights(self.update_weights_from_tensor))
        r.add_post("/destroy_weights_update_group", self._weights(self.destroy_weights_update_group))
        r.add_post("/update_weights_from_disk", self._weights(self.update_weights_from_disk))
        r.add_post("/release_memory_occupation", self._weights(self.release_memory_occupation))
        r.add_post("/resume_memory_occupation", self._weights(self.resume_memory_occupation))
        r.add_post("/load_lora_adapter", self._lora(self.load_lora_adapter))
        r.add_post("/load_lora_adapter_from_tensors", self._lora(self.load_lora_adapter_from_tensors))
        r.add_post("/unload_lora_adapter", self._lora(self.unload_lora_adapter))
        r.add_post("/update_weight_version", self._weights(self.update_weight_version))
        r.add_get("/lora_adapter_checksum", self.lora_adapter_checksum)
        r.add_post("/lora_adapter_checksum", self.lora_adapter_checksum)
        r.add_get("/v1/models", self.v1_models)
        for method in (r.add_get, r.add_post):
            method("/get_weights_by_name", self.get_weights_by_name)
        return app

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        if not raw:
            return {}
        try:
            return loads(raw)
        except ValueError as e:
            raise ProtocolError("body", f"malformed JSON: {e}") from e

    async def _object(self, request: web.Request) -> dict:
        """The body as a JSON object (an empty body: ``{}``); ``ProtocolError`` otherwise."""
        body = await self._body(request)
        if not isinstance(body, dict):
            raise ProtocolError("body", "expected a JSON object")
        return body

    # --- generation ---------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        """``/generate``: one prompt, or SGLang's batch form (one scheduler request per element;
        continuous batching treats them like separate requests). A batch answers a list, in order."""
        try:
            elements, batch = parse_generate_request(await self._body(request), self.runner.vocab_size)
            prompts = [self._prompt_ids(gi, i if batch else None) for i, gi in enumerate(elements)]
            loras = [self.lora.resolve(gi.lora_path) for gi in elements]
        except (ProtocolError, LoraError) as e:
            return _bad(str(e))
        for i, (gi, ids) in enumerate(zip(elements, prompts)):
            if gi.logprob_start_len > len(ids):  # SGLang aborts such a request
                at = f"[{i}]" if batch else ""
                return _bad(f"logprob_start_len{at}: {gi.logprob_start_len} is beyond the prompt's {len(ids)} tokens")
            if loras[i] is not None and (gi.params.max_new_tokens == 0 or (gi.return_logprob and gi.logprob_start_len >= 0)):
                # the prompt is scored outside the scheduler's batches, on whatever adapter is merged then
                return _bad(f"lora_path{'[%d]' % i if batch else ''}: prompt log-probs (logprob_start_len, "
                            "max_new_tokens 0) with a LoRA adapter are not supported by the embedded engine")
        loop = asyncio.get_running_loop()
        # max_new_tokens 0: the prompt is only scored (no scheduler request); the others generate
        futs = [loop.create_future() if gi.params.max_new_tokens else None for gi in elements]
        reqs = [Request(gi.rid, ids, gi.params, _resolver(loop, fut) if fut else _scored, lora=lora)
                for gi, ids, fut, lora in zip(elements, prompts, futs, loras)]
        queued: list[int] = []
        for i, req in enumerate(reqs):
            if futs[i] is None:
                req.finish_reason, req.weight_version = {"type": "length", "length": 0}, self.scheduler.weight_version
                continue
            try:
                self.scheduler.submit(req)
            except RuntimeError as e:  # rid already in flight, or shutting down: the whole request fails
                for j in queued:  # withdraw the elements queued so far (they never ran a step)
                    self.scheduler.abort(reqs[j].rid, "batch rejected")
                if queued:
                    await asyncio.gather(*(futs[j] for j in queued))
                return _bad(f"rid[{i}]: {e}" if batch else f"rid: {e}")
            queued.append(i)
        try:
            prompt_logprobs = await asyncio.gather(*(self._input_logprobs(gi, ids) for gi, ids in zip(elements, prompts)))
            await asyncio.gather(*(futs[j] for j in queued))
        except asyncio.CancelledError:  # the client went away: free every element's slot
            for j in queued:
                if reqs[j].finish_reason is None:
                    self.scheduler.abort(reqs[j].rid, "client disconnected")
            raise
        for i, req in enumerate(reqs):
            if req.error is not None:
                where = f" (element {i})" if batch else ""
                return _bad(f"generation failed{where}: {type(req.error).__name__}: {req.error}", 500)
        out = [self._response(gi, req, lps) for gi, req, lps in zip(elements, reqs, prompt_logprobs)]
        return _json(out if batch else out[0])

    async def _input_logprobs(self, gi: GenerateInput, ids: list[int]) -> list[float | None]:
        """SGLang's ``input_token_logprobs`` values of ``ids[logprob_start_len:]``: ``None`` at the
        first (SGLang scores no token there), then each token's log-prob given the tokens before it;
        none without ``return_logprob`` or at SGLang's default ``-1``. The forward runs in the
        scheduler thread between two steps (never beside a weight update)."""
        start = gi.logprob_start_len
        if not gi.return_logprob or not 0 <= start < len(ids):
            return []
        lps = await asyncio.wrap_future(self.scheduler.run_command(lambda: self.runner.prompt_log_probs(ids)))
        return [None] + lps[start:]

    def _prompt_ids(self, gi: GenerateInput, index: int | None = None) -> list[int]:
        """The prompt's token ids (``text`` tokenized); ``index``: its element in a batch, for errors."""
        at = f"[{index}]" if index is not None else ""
        field = "input_ids" + at
        ids = gi.input_ids
        if ids is None:
            field = "text" + at
            ids = self.runner.tokenizer(gi.text)["input_ids"]
            if not ids:
                raise ProtocolError(field, "tokenizes to no tokens")
        if len(ids) >= self.runner.context_length:
            raise ProtocolError(field, f"the prompt has {len(ids)} tokens; the context length is "
                                f"{self.runner.context_length} (leave room for at least one new token)")
        return ids

    def _response(self, gi: GenerateInput, req: Request, prompt_logprobs: list[float | None]) -> dict:
        p, fr, out = gi.params, req.finish_reason, req.output_ids
        tok = self.runner.tokenizer
        text_ids = out
        if fr.get("type") == "stop" and isinstance(fr.get("matched"), int) and not p.no_stop_trim:
            text_ids = out[:-1]  # SGLang trims a matched stop token from the text
        text = tok.decode(text_ids, skip_special_tokens=p.skip_special_tokens,
                          spaces_between_special_tokens=p.spaces_between_special_tokens)
        if fr.get("type") == "stop" and isinstance(fr.get("matched"), str) and not p.no_stop_trim:
            cut = text.find(fr["matched"])
            if cut >= 0:
                text = text[:cut]
        meta: dict[str, Any] = {
            "id": req.rid, "finish_reason": fr, "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(out), "cached_tokens": 0, "weight_version": req.weight_version,
            "e2e_latency": time.monotonic() - req.arrival}
        if gi.return_logprob:
            scored = req.prompt_ids[len(req.prompt_ids) - len(prompt_logprobs):] if prompt_logprobs else []
            if gi.return_text_in_logprobs:
                pieces = tok.batch_decode([[t] for t in out])
                meta["output_token_logprobs"] = [[lp, t, s] for lp, t, s in zip(req.logprobs, out, pieces)]
                meta["input_token_logprobs"] = [[lp, t, s] for lp, t, s in
                                                zip(prompt_logprobs, scored, tok.batch_decode([[t] for t in scored]))]
            else:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, out)]
                meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(prompt_logprobs, scored)]
        return {"text": text, "output_ids": out, "meta_info": meta}

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await self._object(request)
        except ProtocolError as e:
            return _bad(str(e))
        rid, abort_all = body.get("rid") or "", body.get("abort_all", False)
        if not isinstance(abort_all, bool) or not isinstance(rid, str):
            return _bad("rid/abort_all: expected a string rid and a boolean abort_all")
        if abort_all:
            self.scheduler.abort(None)
        elif rid:
            self.scheduler.abort(rid)
        else:
            return _bad("rid: give a rid or abort_all: true")
        return _json({"success": True})

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            quiet = self.scheduler.pause(body.get("mode", "abort") if isinstance(body, dict) else "abort")
        except ValueError as e:  # ProtocolError too
            return _bad(f"mode: {e}" if not isinstance(e, ProtocolError) else str(e))
        if not quiet:  # return only once the step in progress is over: no forward runs after this
            await asyncio.wrap_future(self.scheduler.run_command(lambda: None))
        return _json({"success": True, "message": "Generation paused."})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.weights.settle()
        self.scheduler.resume()
        return _json({"success": True, "message": "Generation continued."})

    async def flush_cache(self, request: web.Request) -> web.Response:
        # No prefix cache is kept across requests (running requests own their KV), so there is
        # nothing to flush; answer as SGLang does on success.
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be performed.)\n")

    # --- health and info ----------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if not self.scheduler._thread.is_alive():
            return web.Response(status=503, text="scheduler thread is dead")
        return web.Response(text="")

    async def health_generate(self, request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        from .protocol import SamplingParams

        req = Request(f"HEALTH_CHECK_{time.monotonic_ns()}", [0], SamplingParams(max_new_tokens=1, temperature=0.0),
                      lambda r: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r)))
        self.scheduler.submit(req)
        try:
            await asyncio.wait_for(fut, 20.0)
        except asyncio.TimeoutError:
            self.scheduler.abort(req.rid)
            return web.Response(status=503, text="health generation timed out")
        if req.error is not None:
            return web.Response(status=503, text=f"health generation failed: {req.error}")
        return web.Response(text="")

    def _model_info(self) -> dict:
        cfg = self.runner.config
        return {"model_path": self.model_path,
                "tokenizer_path": self.settings.tokenizer_path or self.settings.model_path,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": self.scheduler.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None)}

    async def model_info(self, request: web.Request) -> web.Response:
        return _json(self._model_info())

    async def server_info(self, request: web.Request) -> web.Response:
        s = {k: v for k, v in dataclasses.asdict(self.settings).items() if k not in ("api_key", "admin_api_key")}
        s.update({"model_path": self.model_path, "custom_weight_loader": self.settings.weight_loaders(), "tp_size": 1, "dp_size": 1, "pp_size": 1,
                  "context_length": self.runner.context_length, "skip_tokenizer_init": False,
                  "served_model_name": self.settings.served_model_name or self.model_path,
                  "version": VERSION, "status": "ready",
                  "internal_states": [{"weight_version": self.scheduler.weight_version,
                                       "decode_steps": self.scheduler.steps, "prefills": self.scheduler.prefills,
                                       "finished_reqs": self.scheduler.finished, **self.scheduler.load()}],
                  "weight_update_trace": list(self.weights.trace)})
        return _json(s)

    async def get_load(self, request: web.Request) -> web.Response:
        return _json([{"dp_rank": 0, **self.scheduler.load()}])

    async def v1_models(self, request: web.Request) -> web.Response:
        name = self.settings.served_model_name or self.model_path
        return _json({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "reservoir",
                                                  "root": name, "max_model_len": self.runner.context_length}]})

    async def weights_checksum(self, request: web.Request) -> web.Response:
        """``{name: sha256}`` of the parameters; body/query: optional ``names`` and ``dtype``."""
        try:
            body = await self._body(request) if request.method == "POST" else {}
            names = body.get("names") if isinstance(body, dict) else None
            dtype = body.get("dtype") if isinstance(body, dict) else None
            dtype = dtype or request.query.get("dtype")
            sums = await self.weights.checksums(names, parse_dtype(dtype) if dtype else None)
        except ValueError as e:
            return _bad(str(e))
        return _json(sums)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's ``/get_weights_by_name``: body ``{"name", "truncate_size": 100}`` -> the
        parameter's leading rows as float32 lists (HF names; SGLang's own layout may differ: its
        stacked projections and padded vocabulary); a name not held: 400, as SGLang answers."""
        try:
            body = await self._object(request)
        except ProtocolError as e:
            return _bad(str(e))
        name, count = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str) or isinstance(count, bool) or not isinstance(count, int):
            return _bad("body: needs a string 'name' and an integer 'truncate_size'")
        rows = await self.weights.leading_rows(name, count)
        if rows is None:
            return _bad("Get parameter by name failed")
        return _json(rows)

    async def weights_info(self, request: web.Request) -> web.Response:
        """``{"params": [{name, shape, dtype, tied_to}]}``: what weight_sync validates a push against
        (``tied_to``: the first name sharing this parameter's storage, or null)."""
        first: dict[int, str] = {}
        out = []
        for n, p in self.weights._params.items():
            tied = first.setdefault(p.data_ptr(), n)
            out.append({"name": n, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."),
                        "tied_to": None if tied == n else tied})
        return _json({"params": out})

    # --- weights ------------------------------------------------------------------------------
    def _weights(self, fn: Callable[[dict], Awaitable[str]]) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            try:
                message = await fn(await self._object(request))
            except (ValueError, KeyError, TypeError) as e:  # WeightUpdateError, ProtocolError, missing fields
                msg = f"missing field {e}" if isinstance(e, KeyError) else str(e)
                return _json({"success": False, "message": msg}, 400)
            except Exception as e:  # a collective failed (peer died, timeout): bad state, not bad input
                log.exception("%s failed", request.path)
                return _json({"success": False, "message": f"{type(e).__name__}: {e}"}, 500)
            return _json({"success": True, "message": message})
        return handler

    async def init_weights_update_group(self, b: dict) -> str:
        s = self.settings
        check_master_address(str(b["master_address"]), split_list(s.weight_update_masters))
        await self.weights.init_group(str(b["master_address"]), int(b["master_port"]), int(b["rank_offset"]),
                                      int(b["world_size"]), str(b["group_name"]), str(b.get("backend", "gloo")),
                                      connect_timeout_s=s.weight_update_connect_timeout_s)
        return "Succeeded to initialize custom process group."

    async def begin_weight_update(self, b: dict) -> str:
        self.weights.begin_session()
        return "Success"

    async def end_weight_update(self, b: dict) -> str:
        self.weights.end_session()
        return "Success"

    def _check_flush(self, b: dict) -> None:
        """As SGLang: a weight update that asks for a cache flush needs an idle engine (0.5.15's
        scheduler fails an assertion and the server ends; here the update is refused)."""
        if b.get("flush_cache") and self.scheduler.holds_paused_requests():
            raise WeightUpdateError("flush_cache: requests are held by an in_place or retract pause; the cache "
                                    "cannot be flushed under them (send flush_cache false)")

    async def update_weights_from_distributed(self, b: dict) -> str:
        await self._unmerge_lora()
        self._check_flush(b)
        await self.weights.update_from_distributed(list(b["names"]), list(b["dtypes"]), list(b["shapes"]),
                                                   str(b["group_name"]), b.get("load_format"),
                                                   b.get("weight_version"))
        return "Succeeded to update parameter online."

    async def update_weights_from_tensor(self, b: dict) -> str:
        """SGLang's ``/update_weights_from_tensor`` (colocated mode): TP rank 0's payload is loaded."""
        self._check_flush(b)
        req = parse_request(b)
        await self._unmerge_lora()
        if req.abort_all_requests:
            self.scheduler.abort(None)
        await self.weights.update_from_tensor(req)
        if req.weight_version is None:
            return "Success"
        return f"Success Weight version updated to {req.weight_version}."

    async def _unmerge_lora(self) -> None:
        """Before a full weight update: the weights back to the base (it writes new base values;
        the next request naming an adapter merges it again)."""
        if self.lora.enabled and self.scheduler.lora_merged is not None:
            await self.lora.restore_base()

    async def destroy_weights_update_group(self, b: dict) -> str:
        await asyncio.get_running_loop().run_in_executor(None, self.weights.destroy_group, str(b["group_name"]))
        return "Succeeded to destroy custom process group."

    async def update_weights_from_disk(self, b: dict) -> str:
        await self._unmerge_lora()
        path = str(check_weights_dir(str(b["model_path"]), self.settings.model_path,
                                     split_list(self.settings.weight_update_dirs)))
        await self.weights.update_from_disk(path, b.get("weight_version"))
        return "Succeeded to update model weights."

    async def update_weight_version(self, b: dict) -> str:
        """SGLang's ``/update_weight_version``: the version that later requests report (a LoRA push
        tags its version this way: adapter loads carry none)."""
        if b.get("abort_all_requests", True):
            self.scheduler.abort(None, "aborted by update_weight_version")
        version = str(b["new_version"])
        await asyncio.wrap_future(self.scheduler.run_command(lambda: setattr(self.scheduler, "weight_version", version)))
        return f"Weight version updated to {version}"

    # --- LoRA (SGLang's --enable-lora routes; embedded_engine/lora.py) ------------------------------
    def _lora(self, fn: Callable[[dict], Awaitable[None]]) -> Callable[[web.Request], Awaitable[web.Response]]:
        """SGLang's answer to a LoRA route: ``{success, error_message, loaded_adapters}``, 400 on failure."""
        async def handler(request: web.Request) -> web.Response:
            try:
                await fn(await self._object(request))
            except (ValueError, KeyError, TypeError) as e:  # LoraError, ProtocolError, missing fields
                msg = f"missing field {e}" if isinstance(e, KeyError) else str(e)
                return _json({"success": False, "error_message": msg, "loaded_adapters": self.lora.loaded()}, 400)
            return _json({"success": True, "error_message": None, "loaded_adapters": self.lora.loaded()})
        return handler

    async def load_lora_adapter(self, b: dict) -> None:
        try:
            path = str(check_weights_dir(str(b["lora_path"]), self.settings.model_path,
                                         split_list(self.settings.weight_update_dirs)))
        except ValueError as e:
            raise LoraError("lora_path" + str(e).removeprefix("model_path")) from None
        await self.lora.load_from_path(str(b["lora_name"]), path)

    async def load_lora_adapter_from_tensors(self, b: dict) -> None:
        config = b["config_dict"]
        if not isinstance(config, dict):
            raise ProtocolError("config_dict", "expected the adapter_config.json object")
        # 0.5.23: serialized_named_tensors, one payload per TP rank; 0.5.15.post1: serialized_tensors, one payload
        payloads = b["serialized_named_tensors"] if "serialized_tensors" not in b else [b["serialized_tensors"]]
        tensors = decode_tensors(payloads, b.get("load_format"), b.get("expected_checksums"))
        await self.lora.load(str(b["lora_name"]), config, tensors)

    async def unload_lora_adapter(self, b: dict) -> None:
        self.lora.unload(str(b["lora_name"]))

    async def lora_adapter_checksum(self, request: web.Request) -> web.Response:
        """``{peft tensor name: sha256}`` of a loaded adapter (``lora_name`` in the body or query): the
        read-back ``--check-weight-update-equal`` compares (no SGLang route reads an adapter back)."""
        try:
            body = await self._body(request) if request.method == "POST" else {}
            name = (body.get("lora_name") if isinstance(body, dict) else None) or request.query.get("lora_name")
            sums = await self.lora.checksums(str(name))
        except ValueError as e:
            return _bad(str(e))
        return _json(sums)

    async def release_memory_occupation(self, b: dict) -> str:
        await self.weights.release_memory(_tags(b))
        return "Succeeded to release memory occupation."

    async def resume_memory_occupation(self, b: dict) -> str:
        await self.weights.resume_memory(_tags(b))
        return "Succeeded to resume memory occupation."


def _scored(req: Request) -> None:
    """The ``on_finish`` of a prompt-only request (``max_new_tokens`` 0): never queued, never called."""


def _resolver(loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> Callable[[Request], None]:
    """``Request.on_finish`` (called in the scheduler thread): resolve ``fut`` on the event loop."""
    def on_finish(req: Request) -> None:
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(req))
    return on_finish


def _tags(b: dict) -> list[str]:
    tags = b.get("tags")
    if tags is None:
        return ["weights", "kv_cache"]  # SGLang's default: everything
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ProtocolError("tags", "expected a list of strings")
    return tags


class _OneLineBadRequests(logging.Filter):
    """aiohttp logs a request it cannot parse at ERROR with a traceback; SGLang's uvicorn logs one
    as a one-line warning, and so do we. Except sglang-router's gRPC probe: when a worker is added
    the router tries it over HTTP and gRPC at once (to learn which it speaks), and the gRPC try is
    an HTTP/2 preface (``PRI * HTTP/2.0``), answered 400, which tells the router "not gRPC". That
    one is expected at every start and every engine restart, so it is not logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage) and str(exc.message).startswith("Pause on PRI/Upgrade"):
            return False  # llhttp's stop at an HTTP/2 preface
        if isinstance(exc, BadHttpMessage):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = "Invalid HTTP request received (%s)"
            record.args = (" ".join(line.strip() for line in str(exc).splitlines()[:2]),)
            record.exc_info = record.exc_text = None
        return True


_bad_request_filter = _OneLineBadRequests()


async def start_server(settings: EngineSettings, engine: Engine | None = None) -> tuple[web.AppRunner, Engine]:
    """Build the engine (unless given) and serve it on settings.host:port in the running loop."""
    engine = engine or Engine(settings)
    logging.getLogger("aiohttp.server").addFilter(_bad_request_filter)  # kept once however often called
    runner = web.AppRunner(engine.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, settings.host, settings.port).start()
    log.info("embedded engine serving %s on %s", settings.model_path, settings.url)
    return runner, engine


def serve(settings: EngineSettings) -> None:
    """Run the server until interrupted (what ``python -m embedded_engine`` does)."""
    engine = Engine(settings)  # load the model before binding the port: /health means ready

    async def main() -> None:
        runner, _ = await start_server(settings, engine)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        engine.close()
