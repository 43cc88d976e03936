"""A push casts floating tensors to the engines' dtype while packing (a trainer with fp32 master
weights serving a bf16 engine, issue 13), per bucket, on the trainer: the engine ends up holding
exactly the trainer's weights cast to its dtype, and half the bytes travel. Non-floating
mismatches stay errors. Against the embedded engine (it lists its dtypes: ``/weights_info``) over
each transport; for SGLang (no ``/weights_info``) the dtype comes from ``--sglang-dtype`` and the
model's config (``sglang_serving_dtype``, checked here against SGLang's own rule), and the cast
push into SGLang's own weight updaters is in tests/test_colocate.py (it shares that file's SGLang
oracle engine). Loopback sockets: run via scripts/run_tests.sh.
"""

from __future__ import annotations

import json

import pytest
import torch

from _fixtures_engine import engine_model, engine_model_b, hf_model, run, start_engine, stop_process  # noqa: F401
from sglang_protocol.buckets import tensor_checksum, unflatten_bucket
from sglang_protocol.client import EngineClient
from weight_sync.interfaces import TensorSpec, WeightSyncSettings
from weight_sync.link import Link, TensorChannel
from weight_sync.plan import check_against_engine, plan_buckets, push_specs
from weight_sync.sender import WeightSender


def _spec(name: str, dtype: str, shape=(3,)) -> TensorSpec:
    return TensorSpec(name, tuple(shape), dtype)


def test_push_specs_take_the_engines_floating_dtype():
    trainer = [_spec("a", "float32"), _spec("b", "float32"), _spec("i", "int64"), _spec("c", "bfloat16")]
    bf16 = {s.name: _spec(s.name, "bfloat16") for s in trainer if s.name != "i"} | {"i": _spec("i", "int64")}
    out = push_specs(trainer, [bf16])
    assert [s.dtype for s in out] == ["bfloat16", "bfloat16", "int64", "bfloat16"]
    assert [(s.name, s.shape) for s in out] == [(s.name, s.shape) for s in trainer]
    # SGLang lists nothing: its dtype comes from the launcher; unknown -> the trainer's dtype (the engine casts)
    assert [s.dtype for s in push_specs(trainer, [None], "float16")] == ["float16", "float16", "int64", "float16"]
    assert push_specs(trainer, [None]) == trainer
    # two engines that disagree: each casts at load from the trainer's dtype
    fp16 = {n: _spec(n, "float16") for n in "abc"}
    assert [s.dtype for s in push_specs(trainer, [bf16, fp16])] == ["float32", "float32", "int64", "bfloat16"]
    # an engine that lists names only (None specs) defers to engine_dtype, the others still count
    assert push_specs(trainer[:1], [{"a": None}, bf16], "bfloat16")[0].dtype == "bfloat16"


def test_only_floating_mismatches_are_accepted():
    engine = {"a": _spec("a", "bfloat16"), "i": _spec("i", "int64")}
    check_against_engine([_spec("a", "float32"), _spec("i", "int64")], engine, "http://e")
    with pytest.raises(ValueError, match=r"'i'.*trainer dtype int32 != engine http://e dtype int64.*floating"):
        check_against_engine([_spec("a", "float32"), _spec("i", "int32")], engine, "http://e")
    with pytest.raises(ValueError, match=r"'a'.*trainer dtype int64 != .*bfloat16"):
        check_against_engine([_spec("a", "int64"), _spec("i", "int64")], engine, "http://e")


def _named(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("w0", torch.randn(5, 7, generator=g)), ("w1", torch.randn(3, generator=g).t()),
            ("w2", torch.randn(4, 6, generator=g)[:, ::2]),  # not contiguous
            ("w3", torch.randn(2, 2, generator=g).bfloat16())]


@pytest.mark.parametrize("flattened", [True, False])
def test_packing_casts_into_the_bucket(flattened):
    """Both packers (broadcast and tensor handles) give the bytes of each tensor cast to the bucket's
    dtype; a tensor already in it is packed as it is."""
    named = _named()
    sent = push_specs([TensorSpec.of(n, t) for n, t in named], [None], "bfloat16")
    [bucket] = plan_buckets(sent, 1 << 20)
    want = [t.to(torch.bfloat16) for _, t in named]
    link = Link("g", None, [], torch.device("cpu"), flattened)  # no group: only its packing runs
    packed = link.pack(named, bucket, torch.device("cpu"))
    got = unflatten_bucket(packed[0], [torch.bfloat16] * 4, [t.shape for t in want]) if flattened else packed
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, want))
    obj, keep = TensorChannel(flattened).pack(named, bucket)
    if flattened:
        got = unflatten_bucket(obj["flattened_tensor"], [torch.bfloat16] * 4, [t.shape for t in want])
    else:
        got = [t for _, t in obj]
    assert all(a.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(got, want))


@pytest.fixture(scope="module")
def bf16_engine(engine_model):  # noqa: F811
    proc, url = start_engine(engine_model, dtype="bfloat16", random_seed=0)
    try:
        yield url
    finally:
        stop_process(proc)


def _engine_checksums(url: str) -> dict[str, str]:
    async def go():
        async with EngineClient(url, timeout=60) as c:
            return await c.request("GET", "/weights_checksum")
    return run(go())


def _generates(url: str) -> None:
    async def go():
        async with EngineClient(url, timeout=60) as c:
            out = await c.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3, "temperature": 0})
            assert out["meta_info"]["completion_tokens"] == 3
    run(go())


@pytest.mark.parametrize("transport,load_format", [("distributed", "flattened_bucket"),
                                                   ("distributed", "tensor"), ("tensor", "flattened_bucket")])
def test_fp32_trainer_into_a_bf16_engine_lands_bitwise(bf16_engine, engine_model_b, transport,  # noqa: F811
                                                       load_format):
    """The issue's case: fp32 master weights pushed into a bf16 engine. The push is accepted, half the
    bytes travel, and every engine tensor equals the trainer's cast to bf16, bit for bit (checked by
    the sender itself with --check-weight-update-equal, and again here)."""
    named = [(n, p.detach()) for n, p in hf_model(engine_model_b).named_parameters()]
    assert {t.dtype for _, t in named} == {torch.float32}
    s = WeightSyncSettings(transport=transport, backend="gloo", load_format=load_format, bucket_bytes=64 * 1024,
                           timeout_s=60, check_equal=True)
    with WeightSender(s) as sender:
        sender.connect([bf16_engine])
        m = sender.push(named, version=1)
    fp32_bytes = sum(t.numel() * 4 for _, t in named)
    assert m["weight_sync/cast_tensors"] == len(named) and m["weight_sync/bytes"] == fp32_bytes / 2
    assert m["weight_sync/check_s"] > 0
    sums = _engine_checksums(bf16_engine)
    assert {n: sums[n] for n, _ in named} == {n: tensor_checksum(t, torch.bfloat16) for n, t in named}
    _generates(bf16_engine)


def test_sglang_serving_dtype_follows_sglang(tmp_path):
    """``--sglang-dtype`` and the model's config give the dtype by SGLang's own rule (compared with
    SGLang's ``_get_and_verify_dtype`` where SGLang is installed)."""
    from weight_sync.arguments import sglang_serving_dtype

    cases = [([], {"torch_dtype": "bfloat16", "model_type": "llama"}), ([], {"torch_dtype": "float32"}),
             ([], {"model_type": "qwen2"}), ([], {"dtype": "float16"}), ([], {"torch_dtype": "float32",
                                                                              "model_type": "gemma2"}),
             (["--dtype", "bfloat16"], {"torch_dtype": "float32"}), (["--dtype=half"], {"torch_dtype": "bfloat16"}),
             (["--dtype", "auto"], {"torch_dtype": "bfloat16"}), (["--dtype", "float"], {})]
    try:
        from sglang_oracle import import_sglang

        import_sglang()
        from sglang.srt.configs.model_config import _get_and_verify_dtype
    except ImportError:
        _get_and_verify_dtype = None
    for i, (args, cfg) in enumerate(cases):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        got = sglang_serving_dtype(args, str(d))
        dtype = args[1] if len(args) == 2 else args[0].split("=")[1] if args else "auto"
        if _get_and_verify_dtype is not None:
            want = _get_and_verify_dtype(cfg, dtype)
            assert got == str(want).removeprefix("torch."), (args, cfg)
    assert sglang_serving_dtype([], str(tmp_path / "missing")) is None
    assert sglang_serving_dtype(["--dtype", "int8"], str(tmp_path / "0")) is None


def test_embedded_engine_serves_in_sglangs_dtype_on_cuda():
    """The embedded engine's ``--dtype auto`` on CUDA is SGLang's (a float32 checkpoint served as
    float16, as the real server did on the GPU: bench/NOTES.md), compared with SGLang's own
    ``_get_and_verify_dtype``; on the CPU it stays float32; a named dtype is served as named."""
    from embedded_engine.settings import EngineSettings
    from sglang_oracle import import_sglang

    import_sglang()
    from sglang.srt.configs.model_config import _get_and_verify_dtype

    configs = [{"torch_dtype": "float32", "model_type": "llama"}, {"dtype": "bfloat16", "model_type": "qwen2"},
               {"torch_dtype": "float16"}, {"model_type": "llama"}, {"torch_dtype": "float32", "model_type": "gemma2"}]
    cuda = EngineSettings(model_path="m", device="cuda")
    for cfg in configs:
        assert cuda.torch_dtype_name(cfg) == str(_get_and_verify_dtype(cfg, "auto")).removeprefix("torch."), cfg
        assert EngineSettings(model_path="m").torch_dtype_name(cfg) == "float32"
        assert EngineSettings(model_path="m", device="cuda", dtype="bfloat16").torch_dtype_name(cfg) == "bfloat16"

