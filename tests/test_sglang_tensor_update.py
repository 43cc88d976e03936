"""``/update_weights_from_tensor`` (the colocated weight path), with SGLang 0.5.23's own code on the
other side: the ``tensor`` transport of our ``WeightSender`` pushes into the oracle engine (SGLang's
HTTP route and request struct, its payload normalisation, per TP rank its scheduler updater,
``BaseTpWorker.deserialize_own_rank`` with its allowlisted unpickler and its CUDA-rebuild patch,
and the model-runner ``WeightUpdater`` with ``FlattenedTensorBucket``), and into the embedded
engine; SGLang's own serialiser pushes into the embedded engine.

What runs on this CPU machine and what only on a GPU: on GPUs the payloads hold CUDA IPC handles
(the engine maps the trainer's memory); CUDA IPC cannot run here, so CPU tensors shared through
the same pickling stand in for them (torch shares CPU storage through named shared-memory files).
Exercised here: the request body and its fields, the base64 ForkingPickler payloads, one payload
per TP rank read by that rank alone, SGLang's allowlist accepting every name our pickles use (and
ours accepting SGLang's), both load formats and their metadata, the flush_cache/weight_version
placement, the pause -> begin -> buckets -> end -> continue order, the session rule, and bytes
equal to the trainer's at SGLang's ``load_weights`` and in the embedded engine's model. Only on a
GPU (``tests/test_weight_sync_gpu.py``, marked gpu): CUDA IPC handles themselves (device UUIDs
mapped back to local indices, the producer's event that orders the packing before the engine's
read, the engine reading the trainer's memory before it answers). Loopback sockets: run via
scripts/run_tests.sh.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from _fixtures_engine import engine_model, engine_model_b, engine_url, hf_model, run  # noqa: F401
from sglang_protocol import held_weights
from sglang_protocol.buckets import tensor_checksum
from sglang_protocol.client import EngineClient, EngineError
from sglang_protocol.tensor_update import ROUTE, request_body
from sglang_oracle import running_oracles
from test_sglang_conformance import _assert_received, _get, _weights
from weight_sync.interfaces import WeightSyncSettings
from weight_sync.sender import WeightSender

SESSION_MESSAGE = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
PROMPTS = [[10, 11, 12], [30, 31], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def oracles(toy_model_dir, tmp_path_factory):
    """Two SGLang oracle engines for the module, started in parallel: TP=1 and TP=2."""
    allow = ("--custom-weight-loader", held_weights.LOADER)  # as the engines a run starts
    with running_oracles(toy_model_dir, tmp_path_factory.mktemp("oracle_tensor"),
                         {"tp1": (1, allow), "tp2": (2, allow)}) as urls:
        yield urls


@pytest.mark.parametrize("load_format", ["flattened_bucket", "tensor"])
def test_tensor_transport_into_sglang_tp1_and_tp2(oracles, load_format):
    """One push into a TP=1 and a TP=2 engine: bf16 and fp32 tensors in several buckets; SGLang's
    code opens each rank's own payload and its load_weights gets the trainer's bytes on every rank;
    the session wraps the buckets; only the last bucket flushes and carries the version."""
    named = _weights(21 if load_format == "tensor" else 22)
    version = 5 if load_format == "tensor" else 6
    urls = {"tp1": (oracles["tp1"], 1), "tp2": (oracles["tp2"], 2)}
    control0 = {k: len(_get(u, "/oracle/requests")["control"]) for k, (u, _) in urls.items()}
    calls0 = {k: len(_get(u, "/oracle/tensor_updates")["calls"]) for k, (u, _) in urls.items()}
    s = WeightSyncSettings(transport="tensor", load_format=load_format, bucket_bytes=160, timeout_s=60)
    with WeightSender(s) as sender:
        sender.connect([urls["tp1"][0], urls["tp2"][0]], engine_gpus=[1, 2])
        m = sender.push(named, version=version)
    n = int(m["weight_sync/num_buckets"])
    assert n >= 3 and m["weight_sync/attempts"] == 1
    for k, (url, tp) in urls.items():
        ranks = _get(url, "/oracle/received")["ranks"]
        assert len(ranks) == tp
        for r in ranks:
            _assert_received(r, named)
            assert r["versions"][-n:] == [None] * (n - 1) + [str(version)]
        assert _get(url, "/model_info")["weight_version"] == str(version)
        control = _get(url, "/oracle/requests")["control"][control0[k]:]
        assert control == (["pause_generation", "begin_weight_update"] + ["update_weights_from_tensor"] * n
                           + ["end_weight_update", "continue_generation"]), control
        calls = _get(url, "/oracle/tensor_updates")["calls"][calls0[k]:]
        assert [c["payloads"] for c in calls] == [tp] * n  # one payload per TP rank
        assert {c["load_format"] for c in calls} == {load_format if load_format == "flattened_bucket" else None}
        assert [c["flush_cache"] for c in calls] == [False] * (n - 1) + [True]
        assert [c["weight_version"] for c in calls] == [None] * (n - 1) + [str(version)]


def test_mapped_pushes_into_sglang_open_each_parameter_once(oracles):
    """``mapped``: the trainer's parameters go in one request naming the held-weights loader, which
    SGLang (its --custom-weight-loader list, its WeightUpdater) imports and calls on every TP rank;
    the second push's tensors rebuild onto the storages the loader still holds (nothing is
    opened again) and carry the values changed in place; a non-parameter tensor goes in flattened
    buckets; only the push's last request carries the version; closing lets the engines drop
    what they hold (an empty list, in a session)."""
    named = [(n, torch.nn.Parameter(t, requires_grad=False)) for n, t in _weights(31)[:-1]]
    named.append(("lm_head.weight", torch.randn(3, 5).bfloat16()))  # gathered or converted: not held
    urls = {"tp1": (oracles["tp1"], 1), "tp2": (oracles["tp2"], 2)}
    control0 = {k: len(_get(u, "/oracle/requests")["control"]) for k, (u, _) in urls.items()}
    calls0 = {k: len(_get(u, "/oracle/tensor_updates")["calls"]) for k, (u, _) in urls.items()}
    s = WeightSyncSettings(transport="tensor", load_format="mapped", bucket_bytes=160, timeout_s=60)
    with WeightSender(s) as sender:
        sender.connect([urls["tp1"][0], urls["tp2"][0]], engine_gpus=[1, 2])
        m1 = sender.push(named, version=11)
        with torch.no_grad():
            for _, t in named:
                t.add_(1)  # the optimizer's step: in place
        m2 = sender.push(named, version=12)
    assert m1["weight_sync/held_tensors"] == m2["weight_sync/held_tensors"] == 5
    assert m2["weight_sync/num_buckets"] == 1
    for k, (url, tp) in urls.items():
        ranks = _get(url, "/oracle/received")["ranks"]
        assert len(ranks) == tp
        for r in ranks:
            _assert_received(r, named)
            for n, _ in named[:-1]:
                first, second = r["tensors"][n]["storages"][-2:]
                assert first == second, f"{n}: the second push opened its handle again"
        assert _get(url, "/model_info")["weight_version"] == "12"
        push = ["pause_generation", "begin_weight_update", "update_weights_from_tensor", "update_weights_from_tensor",
                "end_weight_update", "continue_generation"]
        release = ["begin_weight_update", "update_weights_from_tensor", "end_weight_update"]
        assert _get(url, "/oracle/requests")["control"][control0[k]:] == push + push + release
        calls = _get(url, "/oracle/tensor_updates")["calls"][calls0[k]:]
        assert [c["load_format"] for c in calls] == [held_weights.LOADER, "flattened_bucket"] * 2 + [held_weights.LOADER]
        assert [c["weight_version"] for c in calls] == [None, "11", None, "12", None]
        assert [c["payloads"] for c in calls] == [tp] * 5


def test_mapped_needs_engines_that_allow_the_loader(engine_url, monkeypatch):
    """An engine without the loader on its --custom-weight-loader list is refused at connect, with
    the flags to fix it; a request naming a loader off its list is answered 400 naming it."""
    monkeypatch.setattr(held_weights, "LOADER", "elsewhere.not_allowed")
    s = WeightSyncSettings(transport="tensor", load_format="mapped", timeout_s=60)
    with WeightSender(s) as sender, pytest.raises(ValueError, match="--custom-weight-loader elsewhere.not_allowed"):
        sender.connect([engine_url])
    body = request_body([("model.norm.weight", torch.ones(4))], 1, "elsewhere.not_allowed", False)

    async def go():
        async with EngineClient(engine_url, timeout=60) as c:
            assert await c.begin_weight_update()
            try:
                with pytest.raises(EngineError) as e:
                    await c.request("POST", ROUTE, body, admin=True)
            finally:
                await c.end_weight_update()
            return e.value
    err = run(go())
    assert err.status == 400 and "'elsewhere.not_allowed' is not a --custom-weight-loader" in err.body


def test_mapped_pushes_into_the_embedded_engine(engine_url, engine_model, engine_model_b):
    """The embedded engine runs the held-weights loader as SGLang does: a mapped push of other
    weights makes it generate what they generate; weights changed in place reach it at the next
    push; a mapped push of the originals brings them back (checksums equal the trainer's)."""
    model_a, model_b = hf_model(engine_model), hf_model(engine_model_b)
    s = WeightSyncSettings(transport="tensor", load_format="mapped", timeout_s=60, check_equal=True)

    async def greedy() -> list[list[int]]:
        async with EngineClient(engine_url, timeout=60) as c:
            return await _greedy(c)
    with WeightSender(s) as sender:
        sender.connect([engine_url])
        m = sender.push(model_b.named_parameters(), version=21)
        after = run(greedy())
        with torch.no_grad():
            model_b.model.norm.weight.mul_(2)
        sender.push(model_b.named_parameters(), version=22)
        changed = _checksums(engine_url)
        sender.push(model_a.named_parameters(), version=23)
    assert m["weight_sync/held_tensors"] == len(list(model_b.parameters())) and m["weight_sync/num_buckets"] == 0
    assert after == [_hf_greedy(model_b, p) for p in PROMPTS]
    assert changed == {n: tensor_checksum(p) for n, p in model_b.named_parameters()}
    assert _checksums(engine_url) == {n: tensor_checksum(p) for n, p in model_a.named_parameters()}


def test_outside_a_session_sglang_and_the_embedded_engine_refuse_alike(oracles, engine_url):
    """Without /begin_weight_update both refuse the load with SGLang's status and message."""
    body = request_body([("model.norm.weight", torch.ones(4))], 1, None, True, "9")

    async def post(url: str) -> EngineError:
        async with EngineClient(url, timeout=60) as c:
            with pytest.raises(EngineError) as e:
                await c.request("POST", ROUTE, body, admin=True)
            return e.value
    for url in (oracles["tp1"], engine_url):
        err = run(post(url))
        assert err.status == 400 and SESSION_MESSAGE in err.body, (url, err)


class _Gadget:
    """Unpickles as a call of ``os.system``: what an allowlist must refuse."""

    def __reduce__(self):
        import os

        return os.system, ("true",)


def test_the_embedded_engine_refuses_payloads_it_cannot_trust_or_place(engine_url):
    """Inside a session: a pickle naming another global (here os.system) and a flattened bucket
    whose metadata points outside its bytes are refused with 400 naming the problem; nothing loads."""
    import base64
    import pickle

    gadget = {"serialized_named_tensors": [base64.b64encode(pickle.dumps(_Gadget())).decode()]}
    flat = torch.zeros(8, dtype=torch.uint8)  # [bytes]
    from sglang_protocol.tensor_update import flattened_bucket

    bucket = flattened_bucket(["model.norm.weight"], flat, [torch.float32], [[2]])
    bucket["metadata"][0].end_idx = 16  # beyond the 8 bytes sent
    outside = request_body(bucket, 1, "flattened_bucket", True)

    async def go():
        async with EngineClient(engine_url, timeout=60) as c:
            sums = await c.request("GET", "/weights_checksum")
            assert await c.begin_weight_update()
            errs = []
            for b in (gadget, outside):
                with pytest.raises(EngineError) as e:
                    await c.request("POST", ROUTE, b, admin=True)
                errs.append(e.value)
            await c.end_weight_update()
            return errs, sums, await c.request("GET", "/weights_checksum")
    (e_gadget, e_outside), before, after = run(go())
    assert e_gadget.status == 400 and "posix.system is not allowed" in e_gadget.body
    assert e_outside.status == 400 and "bytes [0, 16)" in e_outside.body
    assert after == before


async def _greedy(c: EngineClient) -> list[list[int]]:
    rs = await asyncio.gather(*[c.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 16})
                                for p in PROMPTS])
    return [r["output_ids"] for r in rs]


def _hf_greedy(model, p: list[int], n: int = 16) -> list[int]:
    out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                         do_sample=False, max_new_tokens=n)
    return out[0, len(p):].tolist()


def _checksums(url: str) -> dict[str, str]:
    async def go():
        async with EngineClient(url, timeout=60) as c:
            return await c.request("GET", "/weights_checksum")
    return run(go())


def test_tensor_transport_into_the_embedded_engine(engine_url, engine_model, engine_model_b):
    """A push of other weights (flattened buckets) makes the engine generate what those weights
    generate, its checksums equal the trainer's; a per-tensor push brings the original back."""
    model_a, model_b = hf_model(engine_model), hf_model(engine_model_b)
    s = WeightSyncSettings(transport="tensor", load_format="flattened_bucket", bucket_bytes=64 * 1024, timeout_s=60,
                           check_equal=True)

    async def greedy() -> list[list[int]]:
        async with EngineClient(engine_url, timeout=60) as c:
            return await _greedy(c)
    before = run(greedy())
    with WeightSender(s) as sender:
        sender.connect([engine_url])
        m = sender.push(model_b.named_parameters(), version=1)
        after, sums = run(greedy()), _checksums(engine_url)
        sender.settings.load_format = "tensor"
        sender.push(model_a.named_parameters(), version=2)
    back = run(greedy())
    assert m["weight_sync/num_buckets"] > 2 and m["weight_sync/check_s"] > 0
    assert after == [_hf_greedy(model_b, p) for p in PROMPTS] and after != before
    assert sums == {n: tensor_checksum(p) for n, p in model_b.named_parameters()}
    assert back == before == [_hf_greedy(model_a, p) for p in PROMPTS]
    assert _checksums(engine_url) == {n: tensor_checksum(p) for n, p in model_a.named_parameters()}


def test_a_refused_bucket_fails_the_attempt_and_the_retry_lands(engine_url, engine_model, monkeypatch):
    """The engine refuses the first bucket of a push (a tensor it does not have): the sender
    closes the session on it and redoes the push, whose begin_weight_update would fail on a
    session left open; the redone push lands every tensor."""
    from sglang_protocol import tensor_update

    real, calls = tensor_update.request_body, []

    def first_one_bad(obj, tp_size, load_format, flush_cache, weight_version=None):
        calls.append(1)
        if len(calls) == 1:
            return real([("model.nope.weight", torch.zeros(3))], tp_size, None, flush_cache, weight_version)
        return real(obj, tp_size, load_format, flush_cache, weight_version)
    monkeypatch.setattr(tensor_update, "request_body", first_one_bad)
    model_a = hf_model(engine_model)
    s = WeightSyncSettings(transport="tensor", load_format="flattened_bucket", bucket_bytes=64 * 1024, timeout_s=60,
                           retries=1)
    with WeightSender(s) as sender:
        sender.connect([engine_url])
        m = sender.push(model_a.named_parameters(), version=3)
        errors = sender.engine_status()[engine_url]["errors"]
    assert m["weight_sync/attempts"] == 2 and "model.nope.weight" in errors[-1]
    assert _checksums(engine_url) == {n: tensor_checksum(p) for n, p in model_a.named_parameters()}


def test_sglang_serialised_flattened_bucket_loads_into_the_embedded_engine(engine_url, engine_model,
                                                                          engine_model_b):
    """A payload built by SGLang's own sender code (FlattenedTensorBucket, MultiprocessingSerializer:
    its FlattenedTensorMetadata dataclass in the pickle) loads into the embedded engine."""
    import torch.multiprocessing as tmp
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    names = ["model.norm.weight", "lm_head.weight"]
    a = dict(hf_model(engine_model).named_parameters())
    b = dict(hf_model(engine_model_b).named_parameters())

    def body(params: dict, version: str) -> dict:
        bucket = FlattenedTensorBucket(named_tensors=[(n, params[n].detach()) for n in names])
        obj = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
        return {"serialized_named_tensors": [MultiprocessingSerializer.serialize(obj, output_str=True)],
                "load_format": "flattened_bucket", "flush_cache": True, "weight_version": version}

    async def load(c: EngineClient, params: dict, version: str) -> dict:
        assert await c.begin_weight_update()
        try:
            return await c.request("POST", ROUTE, body(params, version), admin=True)
        finally:
            await c.end_weight_update()

    async def go():
        async with EngineClient(engine_url, timeout=60) as c:
            out = await load(c, b, "sglang-b")
            sums = await c.request("POST", "/weights_checksum", {"names": names})
            await load(c, a, "sglang-a")  # the original values back
            return out, sums, await c.get_weight_version()

    # torch's default CPU sharing passes file descriptors, which only a child process can fetch;
    # SGLang's GPU payloads carry CUDA IPC handles instead. Shared-memory files stand in here.
    strategy = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        out, sums, version = run(go())
    finally:
        tmp.set_sharing_strategy(strategy)
    assert out["success"] and out["message"] == "Success Weight version updated to sglang-b."
    assert sums == {n: tensor_checksum(b[n]) for n in names} and version == "sglang-a"
    assert _checksums(engine_url) == {n: tensor_checksum(p) for n, p in a.items()}
