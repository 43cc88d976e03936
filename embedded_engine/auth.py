"""API keys on the embedded engine, with SGLang's semantics (``--api-key``, ``--admin-api-key``).

SGLang (0.5.23, ``sglang.srt.utils.auth``) gives each route a level:

- normal: with ``--api-key`` set, every request needs ``Authorization: Bearer <api key>``;
- admin-optional (the control routes: pause/continue, abort, flush, the weight updates, memory
  release/resume): with ``--admin-api-key`` set they need that key (the plain key is refused);
  with only ``--api-key`` set, that key; with neither, nothing.

Health, readiness and metrics paths (``/health*``, ``/ready*``, ``/metrics*``) and ``OPTIONS``
requests are always let through (probes carry no secrets). A missing or wrong key is 401
``{"error": "Unauthorized"}``. ``tests/test_engine_auth.py`` checks the route levels against
SGLang's own app and every answer against SGLang's own decision function.
"""

from __future__ import annotations

import hmac
from typing import Awaitable, Callable

from aiohttp import web

# The embedded engine's routes that SGLang marks admin-optional (the rest are normal).
ADMIN_OPTIONAL = frozenset({
    "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
    "/init_weights_update_group", "/begin_weight_update", "/end_weight_update",
    "/update_weights_from_distributed", "/update_weights_from_tensor", "/destroy_weights_update_group",
    "/update_weights_from_disk", "/release_memory_occupation", "/resume_memory_occupation",
    "/get_weights_by_name", "/load_lora_adapter", "/load_lora_adapter_from_tensors", "/unload_lora_adapter",
    "/update_weight_version"})
_ALWAYS_OPEN = ("/health", "/ready", "/metrics")


def _bearer_is(authorization: str | None, key: str) -> bool:
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode())


def refused(method: str, path: str, authorization: str | None, api_key: str | None,
            admin_api_key: str | None) -> bool:
    """Whether SGLang's rule (module docstring) refuses this request."""
    if method == "OPTIONS" or path.startswith(_ALWAYS_OPEN):
        return False
    if path in ADMIN_OPTIONAL and admin_api_key:
        return not _bearer_is(authorization, admin_api_key)
    if api_key:
        return not _bearer_is(authorization, api_key)
    return False


def auth_middleware(api_key: str | None, admin_api_key: str | None) -> Callable:
    """An aiohttp middleware applying :func:`refused` (none needed when neither key is set)."""

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if refused(request.method, request.path, request.headers.get("Authorization"), api_key, admin_api_key):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check
