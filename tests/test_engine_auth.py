"""The embedded engine's ``--api-key`` / ``--admin-api-key`` against SGLang's own auth code: every
route's level is the one SGLang's app gives the same route, and every answer (401 or not) is the
one SGLang's ``decide_request_auth`` gives for that method, path, header and pair of keys."""

from __future__ import annotations

import concurrent.futures as cf
import json
import urllib.error
import urllib.request

import pytest

from _fixtures_engine import engine_model, run, start_engine, stop_process  # noqa: F401
from sglang_oracle import import_sglang
from sglang_protocol.client import EngineClient, EngineError


def _sglang_auth():
    import_sglang()
    import sglang.srt.entrypoints.http_server as hs
    from sglang.srt.utils import auth

    return hs.app, auth


def _scope(method: str, path: str) -> dict:
    return {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"", "headers": []}


def _our_routes(model) -> set[tuple[str, str]]:
    """(method, path) of every route the embedded engine serves (its app, built without a model)."""
    from embedded_engine.server import Engine
    from embedded_engine.settings import EngineSettings

    eng = Engine.__new__(Engine)  # the routing table only: no model runner, no scheduler
    eng.settings = EngineSettings(model_path=str(model))
    return {(r.method, r.resource.canonical) for r in eng.app().router.routes() if r.method in ("GET", "POST")}


def test_route_levels_are_sglangs(engine_model):  # noqa: F811
    from starlette.routing import Match

    from embedded_engine.auth import ADMIN_OPTIONAL

    app, auth = _sglang_auth()
    compared = 0
    for method, path in sorted(_our_routes(engine_model)):
        if not any(r.matches(_scope(method, path))[0] == Match.FULL for r in app.router.routes):
            assert path not in ADMIN_OPTIONAL, f"{path}: ours only, normal level"
            continue
        level = auth._get_auth_level_from_app_and_scope(app, _scope(method, path))
        assert (path in ADMIN_OPTIONAL) == (level == auth.AuthLevel.ADMIN_OPTIONAL), f"{method} {path}: SGLang {level}"
        compared += 1
    assert compared >= 20


# (method, path, body): bodies that fail validation where a route would act, so nothing changes state
CALLS = [("POST", "/generate", {"input_ids": []}), ("GET", "/model_info", None), ("GET", "/server_info", None),
         ("GET", "/health", None), ("GET", "/health_generate", None), ("GET", "/v1/models", None),
         ("POST", "/pause_generation", {"mode": "bogus"}), ("POST", "/flush_cache", None),
         ("POST", "/update_weights_from_disk", {}), ("POST", "/release_memory_occupation", {"tags": ["gpu"]}),
         ("POST", "/init_weights_update_group", {}), ("GET", "/weights_info", None)]
HEADERS = [None, "Bearer k", "Bearer a", "bearer a", "Basic k", "Bearer kk"]
KEYS = {"api": ("k", None), "both": ("k", "a"), "admin": (None, "a")}


def _status(url: str, method: str, path: str, body, header: str | None) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **({"Authorization": header} if header else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_answers_are_sglangs_decisions_and_our_client_sends_the_keys(engine_model):  # noqa: F811
    app, auth = _sglang_auth()
    with cf.ThreadPoolExecutor(len(KEYS)) as ex:
        started = dict(zip(KEYS, ex.map(lambda k: start_engine(engine_model, api_key=k[0], admin_api_key=k[1]),
                                        KEYS.values())))
    try:
        for name, (api_key, admin_key) in KEYS.items():
            url = started[name][1]
            for method, path, body in CALLS:
                level = auth._get_auth_level_from_app_and_scope(app, _scope(method, path))
                for header in HEADERS:
                    want = auth.decide_request_auth(method=method, path=path, authorization_header=header,
                                                    api_key=api_key, admin_api_key=admin_key, auth_level=level)
                    got = _status(url, method, path, body, header)
                    assert (got == 401) == (not want.allowed), f"{name}: {method} {path} {header!r} -> {got}"
            assert "api_key" not in json.loads(urllib.request.urlopen(urllib.request.Request(
                url + "/server_info", headers={"Authorization": f"Bearer {api_key or ''}"}), timeout=30).read())

        async def client_calls(url: str, api_key, admin_key) -> None:
            async with EngineClient(url, timeout=60, api_key=api_key, admin_api_key=admin_key) as c:
                await c.pause_generation("abort")  # admin-optional: the admin key when there is one
                await c.continue_generation()
                out = await c.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
                assert out["meta_info"]["completion_tokens"] == 2
            async with EngineClient(url, timeout=60) as c:
                with pytest.raises(EngineError) as e:
                    await c.pause_generation("abort")
                assert e.value.status == 401
        for name, (api_key, admin_key) in KEYS.items():
            run(client_calls(started[name][1], api_key, admin_key))
    finally:
        for proc, _ in started.values():
            stop_process(proc)
