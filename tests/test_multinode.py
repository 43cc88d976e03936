"""The launcher on a three-node Ray cluster on this machine (issue 27; tests/_fixtures_multinode.py),
joined with ``--ray-address`` as on a real cluster (docs/multinode.md):

- head, 127.0.0.1, 1 CPU: the launcher (driver), the rollout manager and its router, one trainer
  rank (the buffer, unpinned without ``--save``, goes where Ray puts it: it ran on 127.0.0.2);
- 127.0.0.2, 1 CPU: the other trainer rank (``--actor-num-nodes 2``: one rank per node);
- 127.0.0.3, no CPU, custom resource ``rollout: 3``: the engines
  (``--rollout-engine-ray-resources rollout=1``), so no trainer rank can land there.

The trainer's gloo group spans the head and 127.0.0.2, the weight-update group rank 0's node and
127.0.0.3. Where each part ran is read from Ray's own state (the GCS's actor table), not from
what the launcher prints. One cluster serves the module: a node start costs seconds of a 2-core box.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from buffer.arrow import read_parquet
from _fixtures_multinode import RayNodes, actors, cluster_env, driver

ROOT = Path(__file__).resolve().parents[1]
HEAD, TRAINER_NODE, ENGINE_NODE, JOINING_NODE = "127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"
BATCH, N = 4, 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    nodes = RayNodes(tmp_path_factory.mktemp("ray_nodes"))
    try:
        nodes.start(HEAD, num_cpus=1)
        nodes.start(TRAINER_NODE, num_cpus=1)
        nodes.start(ENGINE_NODE, num_cpus=0, resources={"rollout": 3})  # up to 3 engines (the elastic case)
        yield nodes
    finally:
        nodes.stop()


def launcher(model: Path, out: Path, address: str, steps: int, *extra: str, engines: int = 2,
             env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "scripts/train.py"), "--config", str(ROOT / "examples/toy/grpo_cpu.yaml"),
           "--hf-checkpoint", str(model), "--prompt-data", str(model / "data/train.jsonl"),
           "--eval-prompt-data", str(model / "data/eval.jsonl"), "--no-build-toy-model", "--no-plots",
           "--skip-eval-before-train", "--eval-interval", "1000", "--output-dir", str(out),
           "--buffer-name", f"buf-{out.name}", "--ray-address", address,
           "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1",
           "--rollout-num-engines", str(engines), "--rollout-engine-placement", "ray",
           "--rollout-engine-ray-resources", "rollout=1", "--check-weight-update-equal",
           "--num-rollout", str(steps), "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N),
           "--save-debug-rollout-data", str(out / "dump_{rollout_id}.parquet"), *extra]
    # the launcher's own environment carries no RAY_AUTH_MODE: it must turn token auth on itself
    env = {**{k: v for k, v in cluster_env().items() if k != "RAY_AUTH_MODE"}, **(env or {})}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 400) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def train_records(out: Path) -> list[dict]:
    return [r for r in map(json.loads, open(out / "metrics.jsonl")) if "train/loss" in r]


def trained_groups(out: Path, steps: int) -> list[int]:
    return [g[0].group_index for step in range(steps) for g in read_parquet(out / f"dump_{step}.parquet")]


def test_trainer_ranks_engines_and_buffer_run_on_different_nodes_and_push_exact_weights(toy_model_dir, tmp_path,
                                                                                        cluster):
    """Two steps through the launcher on the cluster: each part where the layout above puts it, by
    Ray's actor table; the engines on 127.0.0.3 hold exactly the trainer's weights after each push
    (``--check-weight-update-equal``: a push over a group spanning two nodes); every group once."""
    out = tmp_path / "run"
    proc = launcher(toy_model_dir, out, cluster.address, 2)
    stdout = finish(proc)
    assert proc.returncode == 0, stdout[-6000:]
    steps = train_records(out)
    assert [r["step"] for r in steps] == [0, 1], stdout[-4000:]
    assert all(r["weight_sync/check_s"] > 0 and r["weight_sync/engines"] == 2 for r in steps)
    assert steps[0]["train/train_rollout_logp_abs_diff"] < 1e-4  # the sharded trainer == the engines at step 0
    assert sorted(trained_groups(out, 2)) == list(range(2 * BATCH))

    ran = [a for a in actors(cluster.address) if a["class"] in ("TrainerRank", "EngineHost", "BufferActor",
                                                                    "RolloutManagerActor")]
    job = ran[-1]["job"]  # this run's job: the module's cluster is fresh, this test runs first
    nodes: dict[str, list[str]] = {}
    for a in ran:
        if a["job"] == job:
            nodes.setdefault(a["class"], []).append(a["node"])
    assert sorted(nodes["TrainerRank"]) == [HEAD, TRAINER_NODE], nodes  # one rank per node
    assert nodes["EngineHost"] == [ENGINE_NODE, ENGINE_NODE], nodes
    # the rollout manager (and the router, its child process) on the launcher's node; the buffer
    # (no --save: not pinned) where Ray put it, reached from the other nodes either way
    assert nodes["RolloutManagerActor"] == [HEAD], nodes
    assert len(nodes["BufferActor"]) == 1, nodes
    print(f"placement: {nodes}")


@pytest.mark.slow  # two launcher runs and a node restart: minutes on 2 cores
def test_a_node_killed_mid_run_ends_the_run_and_load_resumes_every_group_exactly_once(toy_model_dir, tmp_path,
                                                                                      cluster):
    """127.0.0.2 (a trainer rank's node) SIGKILLed whole once step 1 trained, as a machine that
    lost power: the run ends naming the dead rank and the checkpoint, as a single-node trainer
    death does (docs/reliability.md); the node comes back (``ray start`` again) and ``--load``
    trains every group exactly once, the engines again exactly the trainer's weights."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    steps = 4
    save = ["--save", str(ckpt), "--save-interval", "1"]
    proc = launcher(toy_model_dir, out, cluster.address, steps, *save)
    wait_for_step(proc, out, 1)
    cluster.kill(TRAINER_NODE)
    stdout = finish(proc)
    assert proc.returncode == 1, stdout[-4000:]
    assert "trainer rank" in stdout and f"add --load {ckpt}" in stdout, stdout[-4000:]
    cluster.start(TRAINER_NODE, num_cpus=1)
    resumed = launcher(toy_model_dir, out, cluster.address, steps, *save, "--load", str(ckpt))
    stdout = finish(resumed)
    assert resumed.returncode == 0, stdout[-4000:]
    records = train_records(out)
    assert sorted({r["step"] for r in records}) == list(range(steps))
    assert all(r["weight_sync/check_s"] > 0 for r in records)
    assert sorted(trained_groups(out, steps)) == list(range(steps * BATCH))


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 300) -> None:
    """Until the run logged train step ``step`` (it goes on meanwhile)."""
    wait_for_record(proc, out, lambda r: r["step"] >= step, timeout)


def wait_for_record(proc: subprocess.Popen, out: Path, test, timeout: float = 300) -> dict:
    """Until the run logged a train step whose record passes ``test`` (it goes on meanwhile); that record."""
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in train_records(out) if test(r)] if (out / "metrics.jsonl").exists() else []
        if found:
            return found[0]
        assert proc.poll() is None and time.monotonic() < deadline, finish(proc)[-4000:]
        time.sleep(0.2)


@pytest.mark.slow  # engines started while the run goes on: minutes on 2 cores
def test_engines_added_and_removed_mid_run_serve_only_current_weights_and_every_group_trains_once(
        toy_model_dir, tmp_path, cluster):
    """An elastic fleet (issue 27): one engine at the start; two added by the rollout manager's
    admin call once step 1 pushed (``grow``, scripts/faults.py: at an exact point of the schedule),
    the first engine removed once step 3 pushed (``shrink``). Every sample of step k was generated
    under weight version k (sync mode): no request reached a new engine before a push gave it the
    current weights. The pushes follow the fleet (``weight_sync/engines``), each leaves the
    engines exactly the trainer's weights (``--check-weight-update-equal``), the fleet size is
    logged per step, and every group trains once."""
    out, steps = tmp_path / "elastic", 6
    proc = launcher(toy_model_dir, out, cluster.address, steps, "--health-check-interval", "0.5", engines=1,
                    env={"RESERVOIR_CRASH_AT": "grow@after_push:1,shrink@after_push:3"})
    stdout = finish(proc)
    assert proc.returncode == 0, stdout[-6000:]
    records = train_records(out)
    assert [r["step"] for r in records] == list(range(steps))
    fleet = [r["rollout/num_engines"] for r in records]
    pushed = [r["weight_sync/engines"] for r in records]
    serving = [r["rollout/engines_serving"] for r in records]
    print(f"fleet per step: {fleet}; engines per push: {pushed}; in the router: {serving}")
    # rollout k runs before push k. The engines added after push 1 are kept out of rollout 2 (they
    # serve the initial weights); push 2 brings them to the current version, and the next monitor
    # round lets them into the router (during rollout 3 or later: when is not fixed); after the
    # shrink they are the fleet
    assert fleet == [1, 1, 3, 3, 2, 2] and pushed == [1, 1, 3, 3, 2, 2], (fleet, pushed)
    assert serving[:3] == [1, 1, 1] and serving[4:] == [2, 2], serving
    assert all(r["weight_sync/check_s"] > 0 for r in records)
    for step in range(steps):  # sync mode: every sample of step k generated under version k
        versions = {v for g in read_parquet(out / f"dump_{step}.parquet") for s in g for v in s.weight_versions}
        assert versions == {step}, (step, versions)
    assert sorted(trained_groups(out, steps)) == list(range(steps * BATCH))


_FLEET_SIZE = """
import time
rollout = ray.get_actor(sys.argv[2], namespace="reservoir")
deadline = time.monotonic() + 120
while len(ray.get(rollout.engine_urls.remote())) != int(sys.argv[3]) and time.monotonic() < deadline:
    time.sleep(0.2)
print(len(ray.get(rollout.engine_urls.remote())))
"""


def held(proc: subprocess.Popen, holds: Path, name: str, timeout: float = 300) -> None:
    """Until the run holds at ``name`` (``hold@...``, scripts/faults.py)."""
    deadline = time.monotonic() + timeout
    while not (holds / f"held_{name}").exists():
        assert proc.poll() is None and time.monotonic() < deadline, finish(proc)[-4000:]
        time.sleep(0.1)


@pytest.mark.slow  # a node started and killed while the run goes on: a minute or more on 2 cores
def test_a_node_that_joins_gets_an_engine_and_one_that_dies_loses_it_while_the_run_goes_on(toy_model_dir, tmp_path,
                                                                                              cluster):
    """``--rollout-fleet-autoscale`` (rollout_manager/autoscale.py): one engine at the start. The run
    is held after push 1 (``hold@``, scripts/faults.py) while a node with room for one more engine
    (``rollout: 1``) joins (``ray start --address``, as on a real cluster); the autoscaler adds an
    engine there, which serves once a push gave it the current weights (every sample of step k is
    generated under version k) and finishes requests of its own
    (``rollout/engine_1_samples_per_s``). Held again after push 20, the node is SIGKILLed whole;
    its engine leaves the fleet, and from push 21 the weight-update group, while the run goes on
    to the end; every group trains once. The fast case of the same logic: tests/test_fleet_elastic.py."""
    out, holds, steps, kill_at = tmp_path / "autoscale", tmp_path / "holds", 40, 20
    holds.mkdir()
    proc = launcher(toy_model_dir, out, cluster.address, steps, "--rollout-fleet-autoscale",
                    "--rollout-fleet-max-engines", "2", "--health-check-interval", "0.5", engines=1,
                    env={"RESERVOIR_CRASH_AT": f"hold@after_push:1,hold@after_push:{kill_at}",
                         "RESERVOIR_HOLD_DIR": str(holds)})
    manager = f"buf-{out.name}-rollout"
    try:
        held(proc, holds, "after_push_1")
        cluster.start(JOINING_NODE, num_cpus=0, resources={"rollout": 1})
        assert driver(cluster.address, _FLEET_SIZE, manager, "2").split()[-1] == "2"  # the autoscaler added one
        (holds / "release_after_push_1").touch()
        held(proc, holds, f"after_push_{kill_at}")
        cluster.kill(JOINING_NODE)
        assert driver(cluster.address, _FLEET_SIZE, manager, "1").split()[-1] == "1"  # and took it out
        (holds / f"release_after_push_{kill_at}").touch()
    finally:
        cluster.kill(JOINING_NODE)
    stdout = finish(proc)
    assert proc.returncode == 0, stdout[-6000:]
    records = train_records(out)
    assert [r["step"] for r in records] == list(range(steps))
    fleet = [int(r["rollout/num_engines"]) for r in records]
    pushed = [int(r["weight_sync/engines"]) for r in records]
    rates = [round(r.get("rollout/engine_1_samples_per_s", 0.0), 1) for r in records]
    print(f"fleet per step: {fleet}; engines per push: {pushed}; engine 1's samples/s per step: {rates}")
    expected = [1] * 2 + [2] * (kill_at - 1) + [1] * (steps - kill_at - 1)  # rollout k runs before push k
    assert fleet == expected and pushed == expected, (fleet, pushed)
    assert any(r > 0 for r in rates[3:kill_at + 1]), rates  # admitted once push 2 reached it, it served
    assert all(r["weight_sync/check_s"] > 0 for r in records)  # every push left the engines the trainer's weights
    for step in range(steps):  # sync mode: every sample of step k generated under version k
        versions = {v for g in read_parquet(out / f"dump_{step}.parquet") for s in g for v in s.weight_versions}
        assert versions == {step}, (step, versions)
    assert sorted(trained_groups(out, steps)) == list(range(steps * BATCH))
