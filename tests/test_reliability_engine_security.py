"""Listeners on loopback, and what the embedded engine's weight endpoints may reach (issue 16,
item 6; docs/security.md). Real sockets, a real engine subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _fixtures_engine import engine_model, run, start_engine, stop_process  # noqa: F401
from sglang_protocol.net import free_port
from sglang_protocol.client import EngineClient, EngineError
from sglang_protocol.process_group import init_weight_update_group

ROOT = Path(__file__).resolve().parents[1]


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on ``port`` (from /proc/net/tcp{,6})."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.split(":")
                if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                    out.add(addr)
    return out


_RANK1 = """
import sys, torch
from sglang_protocol.process_group import init_weight_update_group
g = init_weight_update_group("gloo", "127.0.0.1", int(sys.argv[1]), 1, 2, "sec", 60, connect_timeout_s=60)
y = torch.zeros(4)
g.broadcast(y)
print(y.tolist())
"""


def test_rank0_rendezvous_listens_on_the_master_address_only():
    port = free_port()
    rank1 = subprocess.Popen([sys.executable, "-c", _RANK1, str(port)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        g0 = init_weight_update_group("gloo", "127.0.0.1", port, 0, 2, "sec", 60)
        try:
            assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 / ::
            g0.broadcast(torch.arange(4.0))  # the group works through the bound store
            out, _ = rank1.communicate(timeout=60)
        finally:
            g0.destroy()
    finally:
        rank1.kill()
        rank1.wait()
    assert out.strip() == "[0.0, 1.0, 2.0, 3.0]"


def test_engine_weight_endpoints_refuse_foreign_masters_and_directories_and_time_out(engine_model, tmp_path):
    allowed = tmp_path / "pushed"
    shutil.copytree(engine_model, allowed / "weights_v1")
    proc, url = start_engine(engine_model, weight_update_dirs=str(allowed), weight_update_connect_timeout_s=1.0)

    async def go():
        async with EngineClient(url, timeout=60) as c:
            with pytest.raises(EngineError) as foreign:
                await c.init_weights_update_group("10.1.2.3", 29500, 1, 2, "g", "gloo")
            # nothing listens there: the join fails after the connect timeout, not the 600 s group bound
            with pytest.raises(EngineError) as unreachable:
                await c.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "g2", "gloo")
            refused = []
            for path in ("/etc", "gpt2", str(allowed / ".." / ".." )):
                with pytest.raises(EngineError) as e:
                    await c.update_weights_from_disk(path)
                refused.append(e.value)
            ok_model = await c.update_weights_from_disk(str(engine_model), weight_version="3")
            ok_allowed = await c.update_weights_from_disk(str(allowed / "weights_v1"), weight_version="4")
            return foreign.value, unreachable.value, refused, ok_model, ok_allowed, await c.health()
    try:
        foreign, unreachable, refused, ok_model, ok_allowed, healthy = run(go(), timeout=120)
    finally:
        stop_process(proc)
    assert foreign.status == 400 and "master_address" in foreign.body and "--weight-update-masters" in foreign.body
    assert unreachable.status == 500 and healthy
    assert [e.status for e in refused] == [400] * 3 and all("model_path" in e.body for e in refused)
    assert "Hub ids are not loaded" in refused[1].body and "--weight-update-dirs" in refused[0].body
    assert ok_model["success"] and ok_allowed["success"]


def test_run_started_embedded_engines_get_an_admin_key_through_their_environment(engine_model, tmp_path):  # noqa: F811
    """Embedded engines a run starts answer control calls only with the run's admin key, which
    is in their environment, not their command line; keys given in --engine-extra-args move there
    too. Engines given by --engine-urls get none invented."""
    from _fixtures_rollout import make_args

    from rollout_manager.arguments import with_engine_admin_key
    from embedded_engine.launch import wait_healthy
    from rollout_manager.engines import EnginePorts, engine_command

    base = ["--hf-checkpoint", str(engine_model), "--prompt-data", "unused.jsonl"]
    _, given = make_args(base + ["--engine-extra-args", "--api-key user-key --max-running-requests 4"])
    s = with_engine_admin_key(given)
    e = s.engines
    assert (e.api_key, e.engine_extra_args) == ("user-key", "--max-running-requests 4")
    assert e.admin_api_key and with_engine_admin_key(given).engines.admin_api_key != e.admin_api_key  # random
    assert with_engine_admin_key(make_args(base + ["--engine-urls", "127.0.0.1:1"])[1]).engines.admin_api_key is None
    cmd, env = engine_command(s, 0, EnginePorts(port=free_port()))
    assert not any(k in " ".join(cmd) for k in ("user-key", e.admin_api_key))
    url = "http://127.0.0.1:" + cmd[cmd.index("--port") + 1]
    with open(tmp_path / "engine.log", "wb") as log:
        proc = subprocess.Popen(cmd + ["--num-threads", "1"], env={**os.environ, **env}, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, 120, proc)

        async def calls(api_key, admin_api_key):
            async with EngineClient(url, timeout=30, api_key=api_key, admin_api_key=admin_api_key) as c:
                try:
                    await c.pause_generation("in_place")
                    await c.continue_generation()
                    return "ok"
                except EngineError as err:
                    return err.status
        assert run(calls("user-key", None)) == 401  # the user's key is not the admin key
        assert run(calls("user-key", e.admin_api_key)) == "ok"
    finally:
        stop_process(proc)
