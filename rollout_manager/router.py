"""The real sglang-router: start/stop it, register and remove workers, wait for readiness.

The router's own ``/health`` answers before any worker is registered, so readiness is
``GET /workers`` listing the worker as healthy. Workers are added with ``POST /workers {"url"}``
(queued in the background by the router) and removed with ``DELETE /workers/{id}``.

Cost (bench/rollout.py part c, bench/NOTES.md "## rollout"): sglang-router 0.3.2 parses every
``/generate`` body into a typed request and re-serialises it for the engine, and passes the answer
through. That is ~0.1 ms of router CPU per request on an idle 2-core box (0.2 ms when it shares the
cores with busy engines), almost all of it fixed per request (HTTP in and out, malloc, loopback
TCP): input ids cost ~0.1 us each, the answer's size nothing measurable. None of its flags
(retries, circuit breaker, log level, worker threads) moves that by more than the noise.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rollout_manager.engine_client import EngineClient, EngineError

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host`` (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _norm(url: str) -> str:
    url = url.rstrip("/")
    return url if url.startswith("http") else "http://" + url


class Router:
    """A handle on one sglang-router: started here (``start``) or already running (``attach``)."""

    def __init__(self, host: str, port: int, process: subprocess.Popen | None = None):
        self.host, self.port, self.process = host, port, process
        self.url = f"http://{host}:{port}"

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
        ``--health-check-interval``): their defaults live there. ``extra_args`` (appended: a repeated
        flag overrides ours) and ``env`` (added to this process's environment) are for experiments
        such as bench/rollout.py part (c)."""
        port = port or free_port(host)
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
               "--prometheus-host", host, "--prometheus-port", str(free_port(host)), "--policy", policy,
               # warn, not its default info: info writes two lines per request (~0.4 kB, ~20% of its CPU)
               "--log-level", "warn", "--health-check-interval-secs", str(max(1, int(health_check_interval))),
               # Our client retries on other engines; the router retrying the same dead one only delays that.
               "--retry-max-retries", "1", "--request-timeout-secs", "3600", *extra_args]
        child_env = {**os.environ, **env} if env else None
        if log_path:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as out:  # the child keeps its own descriptor
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=child_env)
        else:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=child_env)
        router = cls(host, port, proc)
        router._wait_up(timeout)
        return router

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
        async with EngineClient(self.url, timeout=10) as c:
            out = await c.request("GET", "/workers")
        return out["workers"]

    async def add_worker(self, url: str, timeout: float = 60.0) -> str:
        """Register ``url`` and wait until the router lists it healthy; returns the worker id."""
        url = _norm(url)
        async with EngineClient(self.url, timeout=10) as c:
            await c.request("POST", "/workers", {"url": url})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for w in await self.list_workers():
                if _norm(w["url"]) == url and w.get("is_healthy", False):
                    return w["id"]
            await asyncio.sleep(0.1)
        raise RuntimeError(f"sglang-router {self.url}: worker {url} not healthy within {timeout:.0f}s")

    async def remove_worker(self, url: str, timeout: float = 30.0) -> bool:
        """Deregister ``url`` (all its entries); returns False if it was not registered."""
        url = _norm(url)
        ids = [w["id"] for w in await self.list_workers() if _norm(w["url"]) == url]
        async with EngineClient(self.url, timeout=10) as c:
            for wid in ids:
                await c.request("DELETE", f"/workers/{wid}")
        deadline = time.monotonic() + timeout
        while ids and time.monotonic() < deadline:  # removal is queued too: wait until it is gone
            if not any(_norm(w["url"]) == url for w in await self.list_workers()):
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


__all__ = ["Router", "free_port", "EngineError"]
