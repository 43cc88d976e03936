"""``slime.utils.http_utils``: ``post`` / ``get`` for plugins that call the router themselves.

``post(url, payload)`` sends JSON and returns the decoded JSON answer (or the text), as slime's
does, with these rules of Reservoir's: connection errors, timeouts, 5xx and 429 answers are retried
(up to ``max_retries``, one second apart, as slime); any other 4xx raises ``httpx.HTTPStatusError``
at once (a bad request stays bad; slime retries it too). Requests to the router or an engine carry
the engines' API key (``--sglang-api-key``) and time out after ``--rollout-request-timeout``. A
``/generate`` answer's ``meta_info.weight_version`` is noted for the sample being generated, so a
custom generate that never records it still produces samples tagged with the policy version; with
``--tito-check`` on, the call (its ``input_ids``, or its ``text`` tokenized as the engine does) is
noted too, so the check compares the sample with what the engine saw.

The concurrency limit (``--sglang-server-concurrency`` x engines) is held by the rollout around
each custom generate call, as slime's ``generate_and_rm`` does: ``post`` itself does not take it.
From a thread or event loop of a plugin's own, the request is sent from the rollout manager's loop
(``plugin_api.on_manager_loop``), with its client, while the caller's loop waits.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx

from rollout_manager.plugin_api import (current_context, note_engine_call, note_weight_versions, on_manager_loop,
                                        on_shutdown)

log = logging.getLogger(__name__)
_clients: dict[int, httpx.AsyncClient] = {}  # one per event loop (a client is bound to its loop)


def _client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    c = _clients.get(id(loop))
    if c is None or c.is_closed:
        c = _clients[id(loop)] = httpx.AsyncClient(timeout=httpx.Timeout(None), trust_env=False,
                                                  limits=httpx.Limits(max_connections=None,
                                                                      max_keepalive_connections=256))
    return c


@on_shutdown
async def close_http_clients() -> None:
    """Close this loop's client (a rollout manager's shutdown runs it, on its loop)."""
    c = _clients.pop(id(asyncio.get_running_loop()), None)
    if c is not None:
        await c.aclose()


def _engine_request(url: str) -> tuple[dict[str, str], float | None]:
    """Headers and timeout for ``url``: the API key and request timeout when it is our router or engine."""
    ctx = current_context(None)
    if ctx is None:
        return {}, None
    bases = [ctx.client.base_url, *ctx.engine_urls()]
    if not any(url.startswith(b.rstrip("/") + "/") for b in bases):
        return {}, None
    key = ctx.settings.engines.api_key
    return ({"Authorization": f"Bearer {key}"} if key else {}), ctx.settings.sampling.request_timeout


def _off_the_managers_loop() -> bool:
    """Inside a rollout manager's process, but on another event loop (a plugin's own)."""
    ctx = current_context(None)
    return ctx is not None and asyncio.get_running_loop() is not ctx.loop


def _retryable(e: Exception) -> bool:
    if isinstance(e, httpx.HTTPStatusError):
        return e.response.status_code >= 500 or e.response.status_code == 429
    return isinstance(e, (httpx.TransportError, asyncio.TimeoutError))


async def post(url: str, payload: dict | None, max_retries: int = 60, headers: dict | None = None) -> Any:
    """POST ``payload`` as JSON to ``url``; the decoded JSON answer (or its text). See the module doc."""
    if _off_the_managers_loop():
        return await on_manager_loop(post(url, payload, max_retries, headers))
    extra, timeout = _engine_request(url)
    payload = _with_adapter(url, payload, timeout is not None)
    attempt = 0
    while True:
        try:
            resp = await _client().post(url, json=payload or {}, headers={**extra, **(headers or {})},
                                        timeout=timeout)
            resp.raise_for_status()
            try:
                out = json.loads(resp.content)
            except json.JSONDecodeError:
                out = resp.text
            break
        except Exception as e:
            attempt += 1
            if not _retryable(e) or attempt >= max_retries:
                raise
            log.info("POST %s failed (%s: %s); retrying (%d/%d)", url, type(e).__name__, e, attempt, max_retries)
            await asyncio.sleep(1.0)
    note_weight_versions(out)
    if isinstance(payload, dict):  # for --tito-check (rollout_manager/tito.py)
        note_engine_call(payload.get("input_ids", _engine_tokens(payload.get("text"))), out)
    return out


def _with_adapter(url: str, payload: dict | None, ours: bool) -> dict | None:
    """With ``--lora-rank``, a plugin's ``/generate`` to our router or engines names the policy's
    adapter (SGLang's ``lora_path``) unless it names one itself: slime's generate functions build
    their own payloads and know nothing of it, and without it they would sample from the base."""
    ctx = current_context(None)
    lora = ctx.settings.sampling.lora_path if ctx is not None else None
    if not (lora and ours and isinstance(payload, dict) and url.rstrip("/").endswith("/generate")):
        return payload
    return payload if "lora_path" in payload else {**payload, "lora_path": lora}


def _engine_tokens(text: Any) -> list[int] | None:
    """The ids an engine makes of a ``text`` prompt (its tokenizer, special tokens as it adds them),
    when --tito-check is on: a generate that sends text (slime's search-r1) is then checked against
    what the engine saw. Tokenized on the loop, as slime's generate tokenizes its own prompts."""
    ctx = current_context(None)
    if not isinstance(text, str) or ctx is None or ctx.tito is None or ctx.tokenizer is None:
        return None
    return ctx.tokenizer(text)["input_ids"]


async def get(url: str) -> Any:
    """GET ``url``; the decoded JSON answer."""
    if _off_the_managers_loop():
        return await on_manager_loop(get(url))
    extra, timeout = _engine_request(url)
    resp = await _client().get(url, headers=extra, timeout=timeout)
    resp.raise_for_status()
    return json.loads(resp.content)


def get_rollout_num_engines(args: Any) -> int:
    """How many engines serve the rollout (the running fleet's, inside a rollout)."""
    ctx = current_context(None)
    if ctx is not None:
        return len(ctx.engine_urls())
    if getattr(args, "rollout_num_engines", None) is not None:
        return int(args.rollout_num_engines)
    gpus = getattr(args, "rollout_num_gpus", 0) or 0
    return max(1, gpus // (getattr(args, "rollout_num_gpus_per_engine", 1) or 1)) if gpus > 0 else 0


def init_http_client(args: Any) -> None:
    """A no-op: the rollout manager owns the HTTP clients (slime builds its global client here)."""
