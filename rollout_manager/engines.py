"""Start, monitor and restart the engines, and keep the router's worker list in step with them.

Kinds (``--rollout-engine``): ``embedded`` (``python -m rollout_manager.engine``, CPU or one GPU),
``sglang`` (``python -m sglang.launch_server`` with the ``--sglang-*`` pass-through flags, one
engine per ``--rollout-num-gpus-per-engine`` GPUs) and ``instant`` (no model: answers at once; for
benchmarks of the client path). ``--engine-urls`` uses running servers instead (never restarted).

The health monitor checks every engine each ``--health-check-interval`` seconds. An engine whose
process exited, or that fails ``/health`` three times in a row, is removed from the router at
once (so retried requests go to the others), then restarted on the same port and re-registered.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_manager.engine_client import EngineClient
from rollout_manager.router import Router, free_port
from rollout_manager.settings import RolloutSettings

log = logging.getLogger(__name__)
FAILURES_BEFORE_RESTART = 3
_REPO_ROOT = str(Path(__file__).resolve().parents[1])


@dataclass
class ManagedEngine:
    """One engine: its URL and, when we started it, the command that (re)starts it."""

    index: int
    url: str
    cmd: list[str] | None  # None: an external server (--engine-urls)
    env: dict[str, str] | None = None
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    failures: int = 0
    restarts: int = 0
    registered: bool = False
    host: Any = None  # the Ray EngineHost actor running it (Ray placement), else None


def engine_command(settings: RolloutSettings, index: int, port: int,
                   host: str = "127.0.0.1") -> tuple[list[str], dict[str, str]]:
    """The command line of engine ``index`` listening on ``host:port``, and the environment it adds."""
    e = settings.engines
    env = {"PYTHONPATH": _REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}  # runnable from any cwd
    model = os.path.abspath(settings.hf_checkpoint or "")
    if e.rollout_engine == "sglang":
        gpus = range(index * e.rollout_num_gpus_per_engine, (index + 1) * e.rollout_num_gpus_per_engine)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))  # local placement; Ray placement overrides it
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", host,
               "--port", str(port), "--tp-size", str(e.rollout_num_gpus_per_engine), *e.sglang_args]
    elif e.rollout_engine == "instant":
        cmd = [sys.executable, "-m", "rollout_manager.instant_engine", "--host", host, "--port", str(port),
               "--model-path", model, *shlex.split(e.engine_extra_args)]
    else:
        from rollout_manager.engine.settings import EngineSettings
        if e.rollout_num_gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(index)
        threads = max(1, (os.cpu_count() or 1) // max(1, e.rollout_num_engines))
        es = EngineSettings(model_path=model, host=host, port=port, device="cuda" if e.rollout_num_gpus else "cpu",
                            random_seed=settings.seed + index, num_threads=None if e.rollout_num_gpus else threads)
        cmd = [sys.executable, "-m", "rollout_manager.engine", *es.to_cli(), *shlex.split(e.engine_extra_args)]
    return cmd, env


class EngineFleet:
    """The engines behind one router; ``start`` launches and registers them, ``stop`` ends them."""

    def __init__(self, settings: RolloutSettings, router: Router, log_dir: str | Path):
        self.settings, self.router = settings, router
        self.log_dir = Path(log_dir)
        self.engines: list[ManagedEngine] = []
        self._monitor: asyncio.Task | None = None
        self._pg: Any = None  # the placement group (Ray placement)
        self.events: list[str] = []  # what the monitor did, for the summary and tests

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def _count(self) -> int:
        e = self.settings.engines
        if e.rollout_engine == "sglang" or e.rollout_num_gpus:
            return max(1, e.rollout_num_gpus // e.rollout_num_gpus_per_engine)
        return e.rollout_num_engines

    async def start(self) -> None:
        e = self.settings.engines
        if e.engine_urls:
            self.engines = [ManagedEngine(i, u.rstrip("/") if u.startswith("http") else "http://" + u.rstrip("/"),
                                          None) for i, u in enumerate(e.engine_urls)]
        else:
            if e.rollout_engine == "sglang":
                try:
                    import sglang  # noqa: F401
                except ImportError:
                    raise ValueError("--rollout-engine sglang: SGLang is not installed "
                                     "(pip install 'reservoir[sglang]' on a GPU machine)") from None
            if not self.settings.hf_checkpoint:
                raise ValueError("--hf-checkpoint is required to start engines")
            self.log_dir.mkdir(parents=True, exist_ok=True)
            hosts: list = [None] * self._count()
            if self._use_ray():
                from rollout_manager.placement import place_engine_hosts
                gpus = e.rollout_num_gpus_per_engine if e.rollout_num_gpus else 0
                self._pg, hosts = place_engine_hosts(len(hosts), gpus, e.engine_startup_timeout)
            for i, host in enumerate(hosts):
                if host is None:
                    ip, port = "127.0.0.1", free_port()
                else:
                    import ray
                    ip, port = ray.get([host.node_ip.remote(), host.free_port.remote()], timeout=60)
                cmd, env = engine_command(self.settings, i, port, ip)
                eng = ManagedEngine(i, f"http://{ip}:{port}", cmd, env, log_path=self.log_dir / f"engine_{i}.log",
                                    host=host)
                self.engines.append(eng)
                self._spawn(eng)
        try:
            await asyncio.gather(*(self._wait_healthy(eng, e.engine_startup_timeout) for eng in self.engines))
            for eng in self.engines:
                await self.router.add_worker(eng.url, timeout=e.engine_startup_timeout)
                eng.registered = True
        except BaseException:
            await self.stop()
            raise
        self._monitor = asyncio.ensure_future(self._monitor_loop())

    def _use_ray(self) -> bool:
        placement = self.settings.engines.rollout_engine_placement
        return placement == "ray" or (placement == "auto" and self.settings.engines.rollout_num_gpus > 0)

    def _spawn(self, eng: ManagedEngine) -> None:
        assert eng.cmd is not None and eng.log_path is not None
        if eng.host is not None:
            import ray

            from rollout_manager.placement import RayProcess
            pid = ray.get(eng.host.start.remote(eng.cmd, eng.env or {}, str(eng.log_path)), timeout=60)
            eng.process = RayProcess(eng.host, pid)
        else:
            with open(eng.log_path, "ab") as out:
                eng.process = subprocess.Popen(eng.cmd, env={**os.environ, **(eng.env or {})}, stdout=out,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.info("engine %d: started pid %d at %s", eng.index, eng.process.pid, eng.url)

    async def _wait_healthy(self, eng: ManagedEngine, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with EngineClient(eng.url, timeout=5) as c:
            while time.monotonic() < deadline:
                if eng.process is not None and eng.process.poll() is not None:
                    raise RuntimeError(f"engine {eng.index} exited with code {eng.process.returncode} at start-up; "
                                       f"see {eng.log_path}")
                if await c.health(timeout=2):
                    return
                await asyncio.sleep(0.2)
        raise RuntimeError(f"engine {eng.index} at {eng.url} not healthy within {timeout:.0f}s; see {eng.log_path}")

    async def _monitor_loop(self) -> None:
        interval = self.settings.engines.health_check_interval
        while True:
            await asyncio.sleep(interval)
            results = await asyncio.gather(*(self.check(eng) for eng in self.engines), return_exceptions=True)
            for eng, r in zip(self.engines, results):
                if isinstance(r, Exception):  # keep monitoring; the next round retries
                    log.error("health check of engine %d failed: %s: %s", eng.index, type(r).__name__, r)

    async def check(self, eng: ManagedEngine) -> None:
        """One health check of ``eng``; removes, restarts and re-registers it when it is dead."""
        exited = eng.process is not None and eng.process.poll() is not None
        if not exited:
            async with EngineClient(eng.url) as c:
                healthy = await c.health(timeout=self.settings.engines.health_check_timeout)
            eng.failures = 0 if healthy else eng.failures + 1
            if healthy:
                if not eng.registered:  # an external engine came back
                    await self.router.add_worker(eng.url)
                    eng.registered = True
                    self.events.append(f"engine {eng.index} re-registered")
                return
        if not exited and eng.failures < FAILURES_BEFORE_RESTART and eng.registered:
            return
        if eng.registered:
            log.warning("engine %d at %s is down (%s); removing it from the router", eng.index, eng.url,
                        f"exit code {eng.process.returncode}" if exited else "not answering")
            await self.router.remove_worker(eng.url)
            eng.registered = False
            self.events.append(f"engine {eng.index} removed")
        if eng.cmd is None or not self.settings.engines.restart_dead_engines:
            return
        if eng.process is not None and eng.process.poll() is None:
            eng.process.kill()  # hung: a restart needs its port
            eng.process.wait(10)
        self._spawn(eng)
        eng.restarts += 1
        try:
            await self._wait_healthy(eng, self.settings.engines.engine_startup_timeout)
            await self.router.add_worker(eng.url)
        except RuntimeError as e:
            log.error("engine %d restart failed: %s", eng.index, e)
            self.events.append(f"engine {eng.index} restart failed")
            return
        eng.registered, eng.failures = True, 0
        self.events.append(f"engine {eng.index} restarted")
        log.warning("engine %d restarted and re-registered at %s", eng.index, eng.url)

    def kill(self, index: int) -> None:
        """Kill engine ``index``'s process (fault injection for tests and drills)."""
        proc = self.engines[index].process
        if proc is None:
            raise RuntimeError(f"engine {index} is external; it cannot be killed from here")
        proc.kill()
        proc.wait(10)

    async def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            try:
                await self._monitor
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping: its last error no longer matters
                pass
            self._monitor = None
        for eng in self.engines:
            if eng.process is not None and eng.process.poll() is None:
                eng.process.terminate()
        for eng in self.engines:
            if eng.process is not None:
                try:
                    eng.process.wait(10)
                except subprocess.TimeoutExpired:
                    eng.process.kill()
                    eng.process.wait(10)
        if self._pg is not None:
            from rollout_manager.placement import release
            release(self._pg, [eng.host for eng in self.engines if eng.host is not None])
            self._pg = None
