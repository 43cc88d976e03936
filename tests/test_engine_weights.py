"""Embedded engine weight updates, driven the way the trainer drives them: the test process is
rank 0 of a gloo weight-update group and broadcasts while the engine's POSTs are in flight.

Needs loopback sockets: run inside ``unshare -n`` as CI does (see _fixtures_engine)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from _fixtures_engine import engine_model, engine_model_b, engine_url, hf_model, run  # noqa: F401
from sglang_protocol.net import free_port
from sglang_protocol.client import EngineClient, EngineError
from sglang_protocol.buckets import dtype_name, flatten_bucket, tensor_checksum
from sglang_protocol.process_group import init_weight_update_group

PROMPTS = [[10, 11, 12], [30, 31], [40, 41, 42, 43, 44]]


def hf_greedy(model, p: list[int], n: int = 16) -> list[int]:
    out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                         do_sample=False, max_new_tokens=n)
    return out[0, len(p):].tolist()


async def greedy(c: EngineClient) -> tuple[list[list[int]], set[str]]:
    rs = await asyncio.gather(*[c.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 16})
                                for p in PROMPTS])
    return [r["output_ids"] for r in rs], {r["meta_info"]["weight_version"] for r in rs}


@pytest.fixture()
def engine(engine_url):
    """One engine for the module: the update test ends by reloading the original weights."""
    return engine_url


def test_update_from_distributed_then_from_disk(engine, engine_model, engine_model_b):
    model_a, model_b = hf_model(engine_model), hf_model(engine_model_b)
    params = {n: p.detach() for n, p in model_b.named_parameters()}
    names = list(params)
    port = free_port()

    async def send(c, group, bucket, flat, version):
        req = asyncio.create_task(c.update_weights_from_distributed(
            bucket, [dtype_name(params[n].dtype) for n in bucket], [list(params[n].shape) for n in bucket],
            "g1", weight_version=version, load_format="flattened_bucket" if flat else None))
        await asyncio.sleep(0.2)
        # the engine is blocked in the broadcast; its event loop must still answer
        assert await c.health(timeout=5) and not req.done()

        def broadcast():
            if flat:
                group.broadcast(flatten_bucket([params[n] for n in bucket]))
            else:
                for n in bucket:
                    group.broadcast(params[n].clone())
        await asyncio.to_thread(broadcast)
        return await req

    async def go():
        async with EngineClient(engine, timeout=120) as c:
            before, _ = await greedy(c)
            init = asyncio.create_task(c.init_weights_update_group("127.0.0.1", port, 1, 2, "g1", "gloo"))
            group = await asyncio.to_thread(init_weight_update_group, "gloo", "127.0.0.1", port, 0, 2, "g1", 60)
            assert (await init)["success"]
            # outside a weight-update session the engine refuses a load, as SGLang >= 0.5.22 does
            with pytest.raises(EngineError) as e_session:
                await c.update_weights_from_distributed(names[:1], ["float32"], [[1]], "g1")
            assert e_session.value.status == 400 and "begin_weight_update" in e_session.value.body
            assert await c.begin_weight_update() is True
            half = len(names) // 2
            assert (await send(c, group, names[:half], False, "v1"))["success"]
            assert await c.get_weight_version() == "v1"
            # a bucket that does not fit the model: 400 naming the tensor, broadcast still drained
            bad = asyncio.create_task(c.update_weights_from_distributed(
                ["model.nope.weight"], ["float32"], [[3]], "g1", weight_version="bad"))
            await asyncio.to_thread(group.broadcast, torch.ones(3))
            with pytest.raises(EngineError) as e:
                await bad
            assert e.value.status == 400 and "model.nope.weight" in e.value.body
            assert (await send(c, group, names[half:], True, "v2"))["success"]  # the group is still in step
            assert await c.end_weight_update() is True
            with pytest.raises(EngineError, match="no weight-update session"):
                await c.end_weight_update()
            after, versions = await greedy(c)
            sums = await c.request("GET", "/weights_checksum")
            version = await c.get_weight_version()
            assert (await c.destroy_weights_update_group("g1"))["success"]
            group.destroy()
            with pytest.raises(EngineError) as e_disk:
                await c.update_weights_from_disk("/nonexistent/model")
            assert (await c.update_weights_from_disk(str(engine_model), weight_version="v3"))["success"]
            back, versions3 = await greedy(c)
            return before, after, versions, sums, version, e_disk.value, back, versions3

    before, after, versions, sums, version, e_disk, back, versions3 = run(go(), timeout=240)
    assert version == "v2" and versions == {"v2"} and versions3 == {"v3"}
    assert before == [hf_greedy(model_a, p) for p in PROMPTS]
    assert after == [hf_greedy(model_b, p) for p in PROMPTS] and after != before
    assert sums == {n: tensor_checksum(p) for n, p in model_b.named_parameters(remove_duplicate=False)}
    assert e_disk.status == 400 and "model_path" in e_disk.body
    assert back == before


def test_init_group_rejects_bad_settings_and_unknown_groups(engine):
    async def go():
        async with EngineClient(engine, timeout=30) as c:
            errs = []
            for call in (c.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "g", "mpi"),
                         c.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[1]], "nope"),
                         c.destroy_weights_update_group("nope"),
                         c.request("POST", "/init_weights_update_group", {"master_address": "127.0.0.1"})):
                with pytest.raises(EngineError) as e:
                    await call
                errs.append((e.value.status, e.value.body))
            ok = await c.generate(input_ids=[5], sampling_params={"max_new_tokens": 1, "ignore_eos": True})
            return errs, ok

    errs, ok = run(go())
    assert [s for s, _ in errs] == [400] * 4
    assert "backend" in errs[0][1] and "begin_weight_update" in errs[1][1] and "nope" in errs[2][1] and "master_port" in errs[3][1]
    assert ok["meta_info"]["completion_tokens"] == 1
