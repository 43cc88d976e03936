"""The real sglang-router: start/stop it, register and remove workers, wait for readiness.

Who may change its workers: a router started here gets a random control-plane admin key
(sglang-router's ``--control-plane-api-keys``), which this handle sends with its ``/workers``
calls; anyone else gets 401 there. Requests (``/generate``...) need no key.

The router's own ``/health`` answers before any worker is registered, so readiness is
``GET /workers`` listing the worker as healthy. Workers are added with ``POST /workers {"url"}``
(queued in the background by the router) and removed with ``DELETE /workers/{id}``.

Health: the router's own checks of a worker are off for the workers added here
(``"disable_health_check": true`` per worker, which also holds on a router attached with
``--sglang-router-ip``). The engine fleet's monitor (``engines.EngineFleet``) is their one judge: it
removes a dead engine from the router, restarts it and adds it back. A second judge with its own
timeout (sglang-router 0.3.2: 5 s, below ``--health-check-timeout``) and threshold could take an
engine out of rotation that the fleet counts as live, or keep one out after the fleet re-added it
(it needs 2 passed checks first); slime turns the router's checks off as well.

Cost (bench/rollout.py part c, bench/NOTES.md "## rollout"): sglang-router 0.3.2 parses every
``/generate`` body into a typed request and re-serialises it for the engine, and passes the answer
through. Almost all of that router CPU is fixed per request (HTTP in and out, malloc, loopback
TCP): the input ids and the answer's size add little (the numbers: bench/NOTES.md). None of its flags
(retries, circuit breaker, log level, worker threads) moves that by more than the noise.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from sglang_protocol.client import EngineClient, EngineError, normalize_url
from sglang_protocol.net import free_port

log = logging.getLogger(__name__)


# sglang-router takes its control-plane key only as a flag, and a command line is readable by every
# local user: the key goes in the environment and this launcher adds it to the router's own argv
# (what /proc/<pid>/cmdline shows is the command below, without it).
_KEY_ENV = "RESERVOIR_ROUTER_CONTROL_PLANE_KEY"
# launch_router imports mini_lb, its Python debugging balancer (used only with --mini-lb), which
# imports FastAPI, uvicorn and, where SGLang is installed, SGLang: seconds of every run's start-up,
# before the engines can register. Without --mini-lb an empty module stands in for it.
_LAUNCH_WITH_KEY = "\n".join((
    "import os, sys, types",
    "if not any(a.startswith('--mini') for a in sys.argv):",
    "    sys.modules['sglang_router.mini_lb'] = types.ModuleType('sglang_router.mini_lb')",
    "    sys.modules['sglang_router.mini_lb'].MiniLoadBalancer = None",
    "from sglang_router.launch_router import main",
    f"sys.argv += ['--control-plane-api-keys', os.environ.pop('{_KEY_ENV}')]",
    "main()"))


class Router:
    """A handle on one sglang-router: started here (``start``) or already running (``attach``)."""

    def __init__(self, host: str, port: int, process: subprocess.Popen | None = None):
        self.host, self.port, self.process = host, port, process
        self.url = f"http://{host}:{port}"
        self._launch: tuple[list[str], dict | None, Path | None] | None = None  # how start() ran it (restart)
        self.admin_key: str | None = None  # the control-plane key of a router started here (/workers)

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system, all threads) the router process has used so far; None when this
        handle did not start it or /proc is not there (not Linux). Nanosecond resolution: the sum of
        the threads' ``schedstat`` (the router's threads live as long as it does)."""
        if self.process is None:
            return None
        total = 0
        try:
            for task in Path(f"/proc/{self.process.pid}/task").iterdir():
                try:
                    total += int((task / "schedstat").read_text().split()[0])
                except (OSError, ValueError, IndexError):  # the thread ended meanwhile
                    continue
        except OSError:
            return None
        return total / 1e9

    @classmethod
    def start(cls, *, policy: str, health_check_interval: float, host: str = "127.0.0.1", port: int | None = None,
              log_path: str | Path | None = None, timeout: float = 60.0, extra_args: Sequence[str] = (),
              env: Mapping[str, str] | None = None) -> "Router":
        """Launch ``python -m sglang_router.launch_router`` on ``host`` and wait until it answers.

        ``policy`` and ``health_check_interval`` come from the settings (``--router-policy``,
        ``--health-check-interval``): their defaults live there; the interval applies to workers
        that others register (ours opt out of the router's checks: ``add_worker``). ``extra_args``
        (appended: a repeated flag overrides ours): the ``--sglang-router-*`` pass-through
        (``EngineFleetSettings.router_args``), or experiments such as bench/rollout.py part (c).
        ``env`` is added to this process's environment."""
        port = port or free_port(host)
        admin_key = secrets.token_urlsafe(24)
        cmd = [sys.executable, "-c", _LAUNCH_WITH_KEY, "--host", host, "--port", str(port),
               "--prometheus-host", host, "--prometheus-port", str(free_port(host)), "--policy", policy,
               # warn, not its default info: info writes two lines per request (~0.4 kB, ~20% of its CPU)
               "--log-level", "warn", "--health-check-interval-secs", str(max(1, int(health_check_interval))),
               # Our client retries on other engines; the router retrying the same dead one only delays that.
               "--retry-max-retries", "1", "--request-timeout-secs", "3600", *extra_args]
        child_env = {**os.environ, **(env or {}), _KEY_ENV: f"reservoir:reservoir:admin:{admin_key}"}
        router = cls(host, port)
        router.admin_key = admin_key
        router._launch = (cmd, child_env, Path(log_path) if log_path else None)
        router._spawn(timeout)
        return router

    def _spawn(self, timeout: float) -> None:
        cmd, child_env, log_path = self._launch
        if log_path:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as out:  # the child keeps its own descriptor
                self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                env=child_env)
        else:
            self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=child_env)
        self._wait_up(timeout)

    def exited(self) -> bool:
        """Whether the router this handle started has exited (an attached one: never known here)."""
        return self.process is not None and self.process.poll() is not None

    def restart(self, timeout: float = 60.0) -> None:
        """Start the router again on its address, as :meth:`start` ran it (blocking: call it from a
        thread). It comes back without workers: the engine fleet registers its engines again."""
        if self._launch is None:
            raise RuntimeError(f"sglang-router {self.url} was not started here; it cannot be restarted")
        self.stop()
        self._spawn(timeout)

    @classmethod
    def attach(cls, host: str, port: int) -> "Router":
        """Use a router that is already running."""
        return cls(host, port, None)

    def _wait_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {self.process.returncode} at start-up")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"sglang-router did not listen on {self.url} within {timeout:.0f}s")

    async def list_workers(self) -> list[dict]:
        """The router's workers: dicts with ``id``, ``url``, ``is_healthy``, ``load``."""
        async with EngineClient(self.url, timeout=10, api_key=self.admin_key) as c:
            out = await c.request("GET", "/workers")
        return out["workers"]

    async def add_worker(self, url: str, timeout: float = 60.0, api_key: str | None = None) -> str:
        """Register ``url`` and wait until the router lists it healthy; returns the worker id.

        ``api_key``: the worker's ``--api-key``, which the router then sends with each request it
        forwards. The router does not health-check the worker (module docstring)."""
        url = normalize_url(url)
        worker: dict = {"url": url, "disable_health_check": True}
        if api_key:
            worker["api_key"] = api_key
        async with EngineClient(self.url, timeout=10, api_key=self.admin_key) as c:
            await c.request("POST", "/workers", worker)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for w in await self.list_workers():
                if normalize_url(w["url"]) == url and w.get("is_healthy", False):
                    return w["id"]
            await asyncio.sleep(0.1)
        raise RuntimeError(f"sglang-router {self.url}: worker {url} not healthy within {timeout:.0f}s")

    async def remove_worker(self, url: str, timeout: float = 30.0) -> bool:
        """Deregister ``url`` (all its entries); returns False if it was not registered."""
        url = normalize_url(url)
        ids = [w["id"] for w in await self.list_workers() if normalize_url(w["url"]) == url]
        async with EngineClient(self.url, timeout=10, api_key=self.admin_key) as c:
            for wid in ids:
                await c.request("DELETE", f"/workers/{wid}")
        deadline = time.monotonic() + timeout
        while ids and time.monotonic() < deadline:  # removal is queued too: wait until it is gone
            if not any(normalize_url(w["url"]) == url for w in await self.list_workers()):
                return True
            await asyncio.sleep(0.1)
        if ids:
            raise RuntimeError(f"sglang-router {self.url}: worker {url} still listed after {timeout:.0f}s")
        return False

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the router if this handle started it."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("sglang-router did not stop in %.0fs; killing it", timeout)
            self.process.kill()
            self.process.wait(timeout)


__all__ = ["Router", "EngineError"]
