"""Engines placed with Ray placement groups: one bundle (its GPUs) per engine.

Each engine server runs as a child process of a small ``EngineHost`` actor scheduled into its
bundle, so Ray decides the node and the GPUs (``CUDA_VISIBLE_DEVICES`` comes from the GPU ids
Ray assigned to the host). The engine inherits the host actor's environment (the node's:
CUDA_HOME, NCCL_*, HF_*, SGLANG_*), as a locally started engine inherits the launcher's
(``procenv.child_environ``). ``RayProcess`` gives the fleet the same ``poll/kill/terminate/wait``
interface as a local ``subprocess.Popen``, so monitoring and restarts are the same code.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_cluster.placement import reserve_placement_group
from rollout_manager.procenv import child_environ
from sglang_protocol.net import pick_port


class EngineHost:
    """Runs one engine server process on the node (and GPUs) of its placement-group bundle."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def node_id(self) -> str:
        """The Ray node this host (and its engine) runs on: the autoscaler removes the engines of a node
        that left."""
        return ray.get_runtime_context().get_node_id()

    def free_port(self, start: int = 0, count: int = 1, taken: list[int] = ()) -> int:
        """A free port on this node (``pick_port``: the OS's pick, or a block from ``start``)."""
        return pick_port(self.node_ip(), start, count, set(taken))

    def start(self, cmd: list[str], env: dict[str, str], log_path: str) -> int:
        env = child_environ(env)  # this node's environment, plus the engine's own variables
        gpu_ids = ray.get_gpu_ids()
        if gpu_ids:  # the GPUs Ray gave this bundle, not the ones the launcher guessed
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(int(g)) for g in gpu_ids)
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, kind: str) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill() if kind == "kill" else self.proc.terminate()

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class RayProcess:
    """A ``Popen``-like handle on the process an ``EngineHost`` runs. A host that is gone (its node
    left the cluster) counts as an ended process: the engine went with its node."""

    _GONE = -9  # the return code of an engine whose host is gone

    def __init__(self, host: Any, pid: int):
        self.host, self.pid, self.returncode = host, pid, None

    def poll(self) -> int | None:
        try:
            self.returncode = ray.get(self.host.poll.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            self.returncode = self._GONE
        return self.returncode

    def kill(self) -> None:
        self._signal("kill")

    def terminate(self) -> None:
        self._signal("terminate")

    def _signal(self, kind: str) -> None:
        try:
            ray.get(self.host.signal.remote(kind), timeout=30)
        except ray.exceptions.RayActorError:
            self.returncode = self._GONE

    def wait(self, timeout: float | None = None) -> int:
        try:
            code = ray.get(self.host.wait.remote(timeout or 10.0), timeout=(timeout or 10.0) + 30)
        except ray.exceptions.RayActorError:
            code = self._GONE
        if code is None:
            raise subprocess.TimeoutExpired("engine", timeout or 10.0)
        self.returncode = code
        return code


def engine_bundle(gpus_per_engine: int, resources: dict[str, float] | None = None) -> dict[str, float]:
    """The Ray resources one engine's placement bundle asks for: its GPUs (and a CPU) on GPUs; on the
    CPU a sliver of a CPU, which keeps CPU engines schedulable next to trainers that take whole
    cores (the engines' own threads are not Ray-accounted). ``resources``
    (``--rollout-engine-ray-resources``) are asked for too, so that the engines go to the nodes
    started with them (``ray start --resources``); on the CPU they take the sliver's place, so a
    node that offers them and no CPU (engines only, no trainer rank) can take the bundle."""
    resources = resources or {}
    return {"GPU": gpus_per_engine, "CPU": 1, **resources} if gpus_per_engine else (resources or {"CPU": 0.01})


def engines_fitting(node_resources: dict[str, float], bundle: dict[str, float]) -> int:
    """How many engine bundles a node of these total resources holds. A bundle of only the CPU
    sliver counts as one per node with a CPU (a hundred CPU engines on one core would not serve)."""
    if set(bundle) == {"CPU"} and bundle["CPU"] < 1:
        return int(node_resources.get("CPU", 0) > 0)
    return int(min(node_resources.get(k, 0.0) // v for k, v in bundle.items()))


def place_engine_hosts(num_engines: int, gpus_per_engine: int, timeout: float,
                       resources: dict[str, float] | None = None, node_ip: str | None = None
                       ) -> tuple[Any, list[Any]]:
    """Reserve one bundle per engine (``engine_bundle``) and start a host in each. ``node_ip``: on
    that node only (the autoscaler's engines for a node that joined), through the resource
    ``node:<ip>`` Ray gives every node."""
    if not ray.is_initialized():
        raise RuntimeError("--rollout-engine-placement ray needs Ray initialised (ray.init) in this process")
    bundle = engine_bundle(gpus_per_engine, resources)
    if node_ip is not None:
        bundle[f"node:{node_ip}"] = 0.001
    pg = reserve_placement_group([bundle] * num_engines, "PACK", timeout, f"{num_engines} engine(s) of {bundle}")
    actor = ray.remote(EngineHost)
    hosts = [actor.options(num_cpus=0, num_gpus=gpus_per_engine or 0,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
             .remote() for i in range(num_engines)]
    return pg, hosts


def release(pg: Any, hosts: list[Any]) -> None:
    for h in hosts:
        ray.kill(h)
    remove_placement_group(pg)
