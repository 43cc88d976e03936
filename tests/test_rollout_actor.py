"""The manager as a Ray actor feeding a real buffer actor (async mode), with put_id de-duplication."""

from __future__ import annotations

from _fixtures_buffer import ray_local  # noqa: F401  (a module-scoped local Ray cluster)
from _fixtures_rollout import make_args, toy_argv

from buffer.interfaces import BufferSettings, create_buffer
from buffer.sample import check_group
from rollout_manager.actor import create_rollout_manager_actor


def test_actor_produces_into_buffer(ray_local, toy_model_dir):  # noqa: F811
    ray = ray_local
    buf = create_buffer("rollout-actor-test", BufferSettings(n_samples_per_prompt=2, capacity=100),
                        namespace="reservoir-tests")
    args, settings = make_args(toy_argv(toy_model_dir, "--rollout-engine", "instant", "--rollout-num-engines", "2",
                                        "--n-samples-per-prompt", "2", "--rollout-batch-size", "4"))
    handle = create_rollout_manager_actor(settings, args)
    try:
        assert len(ray.get(handle.start.remote(), timeout=120)) == 2
        metrics = [ray.get(handle.push.remote(rid, buf), timeout=120) for rid in range(3)]
        assert len(metrics) == 3 and all(m["rollout/num_groups"] == 4 for m in metrics)
        assert ray.get(buf.size.remote()) == 12
        ray.get(handle.push.remote(2, buf), timeout=60)  # a retried rollout id is stored once
        assert ray.get(buf.size.remote()) == 12
        groups = ray.get(buf.get.remote(12, timeout_s=10))
        for g in groups:
            check_group(g, 2)
        assert len({g[0].group_index for g in groups}) == 12
        state = ray.get(handle.state_dict.remote())
        assert state["data_source"]["next_group_index"] == 16
        ray.get(handle.pause.remote())
        ray.get(handle.resume.remote())
        groups, m = ray.get(handle.generate.remote(4), timeout=60)
        assert len(groups) == 4
    finally:
        ray.get(handle.shutdown.remote(), timeout=60)
        ray.kill(handle)
        ray.kill(buf)


def test_engines_in_ray_placement_group(ray_local, toy_model_dir):  # noqa: F811
    import asyncio

    from _fixtures_rollout import running_manager, wait_inflight
    from ray.util import placement_group_table

    from buffer.sample import Status

    async def go():
        argv = toy_argv(toy_model_dir, "--rollout-engine", "instant", "--rollout-num-engines", "2",
                        "--rollout-engine-placement", "ray", "--health-check-interval", "0.5",
                        "--engine-extra-args", "--delay 0.3", "--n-samples-per-prompt", "2",
                        "--rollout-batch-size", "8")
        async with running_manager(argv) as m:
            pg_state = placement_group_table(m.fleet._pg)["state"]
            task = asyncio.ensure_future(m.generate(0))
            await wait_inflight(m, 16)
            m.fleet.kill(0)  # the process inside the Ray host actor
            groups, metrics = await asyncio.wait_for(task, 60)
            for _ in range(300):  # up to 30 s
                if "engine 0 restarted" in m.fleet.events:
                    break
                await asyncio.sleep(0.1)
            again, _ = await m.generate(1)
            return pg_state, groups, metrics, again
    pg_state, groups, metrics, again = asyncio.run(go())
    assert pg_state == "CREATED"
    samples = [s for g in groups for s in g]
    assert len({s.index for s in samples}) == 16 and all(s.status == Status.COMPLETED for s in samples)
    assert len(again) == 8


def test_cli_pushes_into_a_running_buffer(ray_local, toy_model_dir, capsys):  # noqa: F811
    from buffer.interfaces import NAMESPACE
    from rollout_manager.__main__ import main

    buf = create_buffer("rollout-cli-test", BufferSettings(n_samples_per_prompt=2, capacity=100), namespace=NAMESPACE)
    try:
        metrics = main(toy_argv(toy_model_dir, "--rollout-engine", "instant", "--rollout-num-engines", "1",
                                "--n-samples-per-prompt", "2", "--rollout-batch-size", "3", "--num-rollout", "2",
                                "--buffer", "rollout-cli-test"))
        assert ray_local.get(buf.size.remote()) == 6 and metrics["rollout/num_groups"] == 6
        assert "rollout/reward_mean" in capsys.readouterr().out
    finally:
        ray_local.kill(buf)
