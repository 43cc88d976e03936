"""A multi-node Ray cluster on one machine: a head on 127.0.0.1 and worker nodes on 127.0.0.2, .3,
... (every 127.0.0.x is this machine's loopback on Linux, also inside run_tests.sh's loopback-only
namespace), each started by ``ray start --block`` as a user would on a real node
(docs/multinode.md), with its own ``--num-cpus`` and ``--resources``.

Each node's ``ray start`` runs in a session of its own; every process of the node (its raylet,
agents, and the workers of the actors placed there) stays in that session, so :meth:`kill` ends
exactly one node: what a machine that lost power looks like to the rest of the cluster. Token
auth is on (``RAY_AUTH_MODE=token``; the token is ``~/.ray/auth_token``, which ``ray start
--head`` creates when missing), as on a cluster users start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
_UP_S = 120.0  # a node start takes seconds; a 2-core box shared with other suites, a minute or more


def cluster_env(**extra: str) -> dict[str, str]:
    """The environment of everything that joins the cluster (nodes, the launcher, state queries):
    token auth on, read by Ray when it is imported."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RESERVOIR_CRASH_AT")}
    # RAY_memory_monitor_refresh_ms=0: Ray's OOM killer off. It counts the whole machine's memory, and
    # on a box shared with other jobs it killed these tiny runs' actors (at 95% used by others)
    env.update(RAY_AUTH_MODE="token", RAY_DISABLE_USAGE_STATS="1", PYTHONUNBUFFERED="1",
               RAY_memory_monitor_refresh_ms="0", **extra)
    return env


class RayNodes:
    """The nodes of one cluster, by IP. ``start`` adds the head first, then each worker node in turn
    (two raylets starting at once on one machine race for the same socket names)."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        # Ray's temp root of these nodes (RAY_TMPDIR): a `ray start --head` records its address in
        # <root>/ray/ray_current_cluster, and every later ray.init() on the machine without an
        # address (other tests, other users' runs) would join it, dead or not. Short: Ray's unix
        # socket paths live under it.
        self.tmp = tempfile.mkdtemp(prefix="raynodes", dir="/tmp")
        self.procs: dict[str, subprocess.Popen] = {}
        self.args: dict[str, list[str]] = {}
        with socket.socket() as s:  # the GCS port: any free one
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"

    def start(self, ip: str, num_cpus: int, resources: dict[str, float] | None = None) -> None:
        """Start the node at ``ip`` (the head when none runs yet) and wait until Ray says it is up."""
        if ip not in self.args:
            where = ["--head", "--port", str(self.port), "--include-dashboard", "false"] if not self.args \
                else ["--address", self.address]
            self.args[ip] = [*where, "--node-ip-address", ip, "--num-cpus", str(num_cpus),
                             *(["--resources", json.dumps(resources)] if resources else [])]
        log = self.log_dir / f"node_{ip}.log"
        with open(log, "w") as out:
            # the GCS declares a node that stopped answering dead in seconds (Ray's default: half a
            # minute), so that a node killed by a test leaves the cluster while the run goes on
            proc = subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", *self.args[ip]],
                                    env=cluster_env(RAY_TMPDIR=self.tmp, RAY_health_check_period_ms="1000",
                                                    RAY_health_check_failure_threshold="5"), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[ip] = proc
        deadline = time.monotonic() + _UP_S
        while "Ray runtime started" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                self.kill(ip)
                raise RuntimeError(f"ray node {ip} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    def kill(self, ip: str) -> None:
        """SIGKILL every process of node ``ip`` (its session), as a machine that died."""
        proc = self.procs.pop(ip, None)
        if proc is None:
            return
        for pid in _session_pids(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(30)

    def stop(self) -> None:
        """End every node, the head last."""
        for ip in sorted(self.procs, reverse=True):
            self.kill(ip)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _session_pids(sid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == sid:
                    pids.append(int(d.name))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def driver(address: str, code: str, *args: str, timeout: float = 300) -> str:
    """Run ``code`` in a Ray driver of its own joined to the cluster (``sys.argv[1]``: the address,
    then ``args``); its stdout. Its own process: the test process may have imported Ray already
    without token auth (other modules' local clusters), and Ray reads RAY_AUTH_MODE on import."""
    prelude = ("import json, sys, ray\n"
               "ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)\n")
    out = subprocess.run([sys.executable, "-c", prelude + code, address, *args], env=cluster_env(),
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


_LIST_ACTORS = """
ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
out = [{"class": a["ActorClassName"].rsplit(".", 1)[-1], "node": ips.get(a["Address"]["NodeID"]),
        "state": a["State"], "job": a["JobID"]} for a in ray._private.state.actors().values()]
print(json.dumps(out))
"""


def actors(address: str) -> list[dict]:
    """Every actor the cluster's GCS knows (dead ones too), with the IP of the node it ran on."""
    return json.loads(driver(address, _LIST_ACTORS).strip().splitlines()[-1])
