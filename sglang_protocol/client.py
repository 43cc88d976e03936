"""The engine client: one async client for SGLang's native HTTP API.

The same code talks to real SGLang servers, to the embedded engine and to sglang-router
(which forwards ``/generate``). Payload field names are SGLang's (``srt/managers/io_struct.py``);
``tests/test_sglang_conformance.py`` builds SGLang's own request structs from every body sent here.
Supported servers: SGLang 0.5.15 (slime's base) to 0.5.23. Where they differ the client follows
the newer one and falls back on a 404: the weight-update session (``/begin_weight_update``,
``/end_weight_update``, 0.5.22+) and the weight version (``/model_info``; ``/get_weight_version``
before 0.5.22). Where a route is the same but its body differs, the sender picks the body by the
release the server reports (:meth:`EngineClient.sglang_release`): the LoRA load from tensors
(``sglang_protocol/lora_adapter.py``).
It is built on aiohttp: under high concurrency it sustains several thousand requests/s on two
cores, where httpx manages a few hundred (ENVIRONMENT.md, bench/rollout).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp

from sglang_protocol.net import dumps, dumps_bytes, loads


_JSON = {"Content-Type": "application/json"}


class EngineError(RuntimeError):
    """An engine answered with an HTTP error, or could not be reached."""

    def __init__(self, url: str, status: int | None, body: str):
        self.url, self.status, self.body = url, status, body
        super().__init__(f"{url}: HTTP {status}: {body[:500]}" if status is not None else f"{url}: {body}")


class EngineClient:
    """Async client for one SGLang-compatible server (an engine or the router).

    Create it inside a running event loop. ``timeout`` bounds every request (seconds, None = no
    bound). Pass a shared ``session`` to pool connections across clients; else one is owned.
    ``api_key`` / ``admin_api_key``: the server's ``--api-key`` / ``--admin-api-key``, sent as
    ``Authorization: Bearer``; control calls (weights, pause, flush, abort) send the admin key
    when there is one, as SGLang requires for its admin endpoints once an admin key is set.
    """

    def __init__(self, base_url: str, timeout: float | None = None,
                 session: aiohttp.ClientSession | None = None, api_key: str | None = None,
                 admin_api_key: str | None = None):
        self.base_url = normalize_url(base_url)
        self._owns_session = session is None
        self._session = session or new_session()
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._headers = _auth(api_key)
        self._admin_headers = _auth(admin_api_key or api_key)
        self._release: tuple[int, int, int] | None = None
        self._release_read = False  # the release is read once (a server does not change it)

    async def close(self) -> None:
        """Close the HTTP session if this client owns it (a shared ``session`` stays open)."""
        if self._owns_session:
            await self._session.close()

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def request(self, method: str, path: str, payload: dict | None = None,
                      timeout: float | None = None, admin: bool = False) -> Any:
        """Send one request; return the decoded JSON (or text) body; raise EngineError on failure.
        ``admin``: a control call (sends the admin key, if one was given)."""
        url = self.base_url + path
        t = aiohttp.ClientTimeout(total=timeout) if timeout is not None else self._timeout
        headers = self._admin_headers if admin else self._headers
        try:
            # bytes in, bytes out: serialise once to bytes and parse the body bytes directly (aiohttp's
            # json= / resp.json() add a str round trip each way)
            data = dumps_bytes(payload) if payload is not None else None
            if data is not None:
                headers = {**headers, **_JSON} if headers else _JSON
            async with self._session.request(method, url, data=data, headers=headers or None,
                                             timeout=t) as resp:
                body = await resp.read()
                if resp.status >= 400:
                    raise EngineError(url, resp.status, body.decode("utf-8", "replace"))
                if resp.content_type == "application/json":
                    return loads(body)
                text = body.decode("utf-8", "replace")
                return text
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise EngineError(url, None, f"{type(e).__name__}: {e}") from e

    # --- generation ------------------------------------------------------------------------
    async def generate(self, input_ids: list[int] | None = None, text: str | None = None,
                       sampling_params: dict | None = None, return_logprob: bool = True,
                       rid: str | None = None, timeout: float | None = None, lora_path: str | None = None) -> dict:
        """POST /generate. Returns SGLang's response: ``text``, ``output_ids``, ``meta_info``.
        ``lora_path``: the loaded LoRA adapter to generate with (SGLang's; its ``lora_name``)."""
        payload: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        if lora_path is not None:
            payload["lora_path"] = lora_path
        if input_ids is not None:
            payload["input_ids"] = input_ids
        if text is not None:
            payload["text"] = text
        if rid is not None:
            payload["rid"] = rid
        return await self.request("POST", "/generate", payload, timeout)

    async def generate_batch(self, input_ids: list[list[int]], sampling_params: dict | None = None,
                             return_logprob: bool = True, rid: str | None = None,
                             timeout: float | None = None, lora_path: str | None = None) -> list[dict]:
        """POST /generate in SGLang's batch form: several prompts, one shared ``sampling_params``.

        Returns one response per prompt, in order. ``rid`` (one string) names the batch; the
        engine gives element ``i`` the rid ``batch_rids(rid, n)[i]`` (``f"{rid}_{i}"``), which
        ``abort_request`` takes to abort that element alone. The form is what sglang-router 0.3.2
        forwards: it rejects (HTTP 422) a list of rids, sampling params or return_logprob flags
        (tests/test_router_batch.py). Raises EngineError if the answer is not one dict per prompt.
        """
        if not input_ids:
            raise ValueError("input_ids: an empty batch")
        payload: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params or {},
                                   "return_logprob": return_logprob}
        if lora_path is not None:  # one adapter for the whole batch
            payload["lora_path"] = lora_path
        if rid is not None:
            payload["rid"] = rid
        out = await self.request("POST", "/generate", payload, timeout)
        if not isinstance(out, list) or len(out) != len(input_ids) or not all(isinstance(o, dict) for o in out):
            got = f"a list of {len(out)}" if isinstance(out, list) else type(out).__name__
            raise EngineError(self.base_url + "/generate", None,
                              f"a batch of {len(input_ids)} prompts was answered with {got}, not one object each")
        return out

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> Any:
        """POST /abort_request: abort request ``rid``, or every request with ``abort_all``.

        A real SGLang server matches ``rid`` as a prefix (see ``batch_rids``).
        """
        return await self.request("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all}, admin=True)

    async def pause_generation(self, mode: str = "abort") -> Any:
        """POST /pause_generation: stop generating until ``continue_generation``.

        SGLang's ``mode``: ``abort`` (in-flight requests are aborted and return), ``retract`` (they go back to the
        waiting queue) or ``in_place`` (they stay, with their KV cache).
        """
        return await self.request("POST", "/pause_generation", {"mode": mode}, admin=True)

    async def continue_generation(self) -> Any:
        """POST /continue_generation: resume generation after ``pause_generation``."""
        return await self.request("POST", "/continue_generation", {}, admin=True)

    async def flush_cache(self) -> Any:
        """POST /flush_cache: clear the engine's KV (prefix) cache.

        SGLang refuses while requests are pending (HTTP 400: raises EngineError).
        """
        return await self.request("POST", "/flush_cache", admin=True)

    # --- weights ---------------------------------------------------------------------------
    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str,
                                        timeout: float | None = None) -> dict:
        """POST /init_weights_update_group: join the weight-update group ``group_name`` from ``rank_offset``.

        Trainer rank 0 hosts the rendezvous at ``master_address:master_port`` and must join meanwhile
        (``weight_sync.link.open_link``); the call returns once the group is formed.
        """
        return await self.request("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}, timeout, admin=True)

    async def begin_weight_update(self, timeout: float | None = None) -> bool:
        """POST /begin_weight_update (SGLang >= 0.5.22 loads weights only inside such a session).
        True: a session is open; False: the server has no such route (older SGLang: none needed)."""
        return await self._session_call("/begin_weight_update", timeout)

    async def end_weight_update(self, timeout: float | None = None) -> bool:
        """POST /end_weight_update: close the session (SGLang runs post-load processing here).
        True: closed; False: the server has no such route."""
        return await self._session_call("/end_weight_update", timeout)

    async def _session_call(self, path: str, timeout: float | None) -> bool:
        try:
            out = await self.request("POST", path, {}, timeout, admin=True)
        except EngineError as e:
            if e.status == 404:
                return False
            raise
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(self.base_url + path, None, str(out.get("message")))
        return True

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, weight_version: str | None = None,
                                              flush_cache: bool = True, load_format: str | None = None,
                                              timeout: float | None = None) -> dict:
        """POST /update_weights_from_distributed: receive the tensors ``names`` over group ``group_name``.

        Rank 0 broadcasts them while this request is in flight (``weight_sync.link.send_bucket``);
        ``weight_version``, if given, becomes the version the engine reports.
        """
        payload: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                   "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        return await self.request("POST", "/update_weights_from_distributed", payload, timeout, admin=True)

    async def update_weights_from_tensor(self, body: dict, timeout: float | None = None) -> dict:
        """POST /update_weights_from_tensor with a body from ``sglang_protocol.tensor_update.request_body``
        (serialised tensor handles per TP rank; the colocated transport)."""
        return await self.request("POST", "/update_weights_from_tensor", body, timeout, admin=True)

    async def destroy_weights_update_group(self, group_name: str) -> dict:
        """POST /destroy_weights_update_group: leave the weight-update group ``group_name``."""
        return await self.request("POST", "/destroy_weights_update_group", {"group_name": group_name}, admin=True)

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       timeout: float | None = None) -> dict:
        """POST /update_weights_from_disk: load the weights at ``model_path`` (a path on the engine's host).

        ``weight_version``, if given, becomes the version the engine reports.
        """
        payload: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self.request("POST", "/update_weights_from_disk", payload, timeout, admin=True)

    # --- memory (colocated mode) ------------------------------------------------------------
    async def release_memory_occupation(self, tags: list[str] | None = None, timeout: float | None = None) -> Any:
        """POST /release_memory_occupation: free the engine's GPU memory of ``tags`` (SGLang's
        ``ReleaseMemoryOccupationReqInput``: ``weights``, ``kv_cache``, ``cuda_graph``; None: all)
        for a trainer on the same GPU. SGLang releases only an idle engine (pause it first) and
        only with ``--enable-memory-saver``; it answers ``null`` on success."""
        return await self.request("POST", "/release_memory_occupation", _tags_body(tags), timeout, admin=True)

    async def resume_memory_occupation(self, tags: list[str] | None = None, timeout: float | None = None) -> Any:
        """POST /resume_memory_occupation: take back the memory of ``tags`` (SGLang's
        ``ResumeMemoryOccupationReqInput``; None: all). Resume only tags that were released: SGLang's
        scheduler fails on one it does not hold as released."""
        return await self.request("POST", "/resume_memory_occupation", _tags_body(tags), timeout, admin=True)

    async def get_weight_version(self) -> str | None:
        """The weight version the server reports: ``/model_info``'s ``weight_version`` (SGLang
        0.5.22+), else ``/get_weight_version`` (older servers)."""
        info = await self.model_info()
        if isinstance(info, dict) and "weight_version" in info:
            return info["weight_version"]
        out = await self.request("GET", "/get_weight_version")
        return out["weight_version"] if isinstance(out, dict) else str(out)

    # --- health and info -------------------------------------------------------------------
    async def health(self, timeout: float | None = 5.0) -> bool:
        """GET /health: True when the server answers, False on an HTTP error, a timeout or no connection."""
        try:
            await self.request("GET", "/health", timeout=timeout)
            return True
        except EngineError:
            return False

    async def health_generate(self, timeout: float | None = 30.0) -> bool:
        """GET /health_generate (SGLang generates one token when idle): True on success, False as ``health``."""
        try:
            await self.request("GET", "/health_generate", timeout=timeout)
            return True
        except EngineError:
            return False

    async def model_info(self) -> dict:
        """GET /model_info: the model path, ``weight_version`` (SGLang 0.5.22+) and other model facts."""
        return await self.request("GET", "/model_info")

    async def server_info(self) -> dict:
        """GET /server_info: the server's launch arguments and live scheduler state."""
        return await self.request("GET", "/server_info")

    async def sglang_release(self) -> tuple[int, int, int] | None:
        """The SGLang release the server runs, ``(major, minor, patch)`` of ``/server_info``'s
        ``version`` (``0.5.15.post1`` -> ``(0, 5, 15)``), read once per client; None where that
        is no SGLang version (the embedded engine, which speaks the newest supported release) or
        the server has no ``/server_info``. EngineError on any other failure."""
        if not self._release_read:
            try:
                info = await self.server_info()
            except EngineError as e:
                if e.status != 404:
                    raise
                info = {}
            version = info.get("version") if isinstance(info, dict) else None
            self._release, self._release_read = parse_release(version), True
        return self._release

    async def gpu_count(self) -> int:
        """The GPUs (ranks in a weight-update group) the server runs on: ``/server_info``'s
        ``tp_size`` x ``pp_size`` (a missing field counts as 1: the embedded engine)."""
        info = await self.server_info()
        return int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1)

    async def get_weights_by_name(self, name: str, truncate_size: int, timeout: float | None = None) -> list:
        """POST /get_weights_by_name (SGLang's ``GetWeightsByNameReqInput``): the first
        ``truncate_size`` rows of parameter ``name`` (an HF name) as nested float lists, read from
        TP rank 0; the server answers 400 where its model cannot read a name back (SGLang
        implements it for llama-family models only)."""
        return await self.request("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size},
                                  timeout=timeout, admin=True)


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port``."""
    url = url.strip().rstrip("/")
    return url if url.startswith(("http://", "https://")) else "http://" + url


def _tags_body(tags: list[str] | None) -> dict[str, Any]:
    """The body of a memory-occupation call: SGLang's ``tags`` field, left out for "all"."""
    return {} if tags is None else {"tags": list(tags)}


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def batch_rids(rid: str, n: int) -> list[str]:
    """The per-element rids SGLang gives a batch ``/generate`` whose ``rid`` is one string.

    SGLang aborts by rid *prefix*: on a real SGLang server, aborting ``f"{rid}_1"`` also aborts
    ``f"{rid}_10"``... (the embedded and instant engines match exactly). The rollout only aborts
    whole steps' requests, so this never hits an element that should keep running."""
    return [f"{rid}_{i}" for i in range(n)]


def parse_release(version: Any) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of an SGLang version string (``"0.5.15.post1"``, ``"0.5.23"``,
    ``"0.5.24rc0"``); None for anything else."""
    m = re.match(r"v?(\d+)\.(\d+)\.(\d+)(?!\d)", str(version or "").strip())
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def new_session(limit: int = 0) -> aiohttp.ClientSession:
    """A session for many concurrent requests (``limit=0``: no cap on pooled connections)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, ttl_dns_cache=300),
                                 json_serialize=dumps)
