"""WeightSender over NCCL (run on a 2-GPU machine): trainer tensors on cuda:0, one embedded engine
on cuda:1. A push lands exactly (checksums); an engine killed mid-push or stopped (SIGSTOP) makes
the push fail within its bound instead of hanging the trainer on a stuck NCCL kernel; the engine,
restarted or resumed, is brought back (resync / revive) through a rebuilt NCCL group. On one GPU:
the engine's CUDA side of a gloo push, and the colocated ``tensor`` transport (CUDA IPC handles).

    pytest -m gpu tests/test_weight_sync_gpu.py      (or: python tests/test_weight_sync_gpu.py)
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests._fixtures_weight_sync import perturbed_model, stop_engines, ws_toy_model  # noqa: F401

pytestmark = pytest.mark.gpu


def _engine(model: Path, port: int = 0, device: str = "cuda:1") -> tuple:
    from embedded_engine.launch import launch_engine_process
    from embedded_engine.settings import EngineSettings

    return launch_engine_process(EngineSettings(model_path=str(model), port=port, device=device,
                                                dtype="float32", max_running_requests=8), timeout_s=180)


def _assert_engine_holds(url: str, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> None:
    """Every engine tensor's checksum equals the trainer's (cast to ``dtype`` if given; read after
    the push, not inside it)."""
    import json
    import urllib.request

    from sglang_protocol.buckets import tensor_checksum

    with urllib.request.urlopen(f"{url}/weights_checksum", timeout=60) as r:
        sums = json.loads(r.read())
    sums = sums.get("checksums", sums)
    bad = [n for n, t in named if sums.get(n) != tensor_checksum(t, dtype)]
    assert not bad, f"{len(bad)} tensors differ on the engine (the trainer's cast to {dtype}), e.g. {bad[:3]}"


def _generates(url: str) -> None:
    import json
    import urllib.request

    body = json.dumps({"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    req = urllib.request.Request(f"{url}/generate", data=body.encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert json.loads(r.read())["meta_info"]["completion_tokens"] == 4


def test_gloo_push_into_a_cuda_engine_lands(ws_toy_model):  # noqa: F811
    """One GPU: the engine's CUDA side of a push (copies on its side stream, the last bucket's copy
    queued inline while paused, the forwards' stream waiting for the copies) with gloo transfers;
    a push of other values, then generation, then a check of every tensor."""
    from weight_sync.interfaces import WeightSyncSettings

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _push_check_generate(ws_toy_model, WeightSyncSettings(backend="gloo", bucket_bytes=32 * 1024, timeout_s=20),
                         "cuda:0", lambda scale: [(n, p.detach()) for n, p in
                                                  perturbed_model(ws_toy_model, scale).named_parameters()])


def test_nccl_push_without_check_lands(ws_toy_model):  # noqa: F811
    """The default fast path over NCCL (no check inside the push: receives issued after each
    answer, continue sent while the last transfers end): every tensor lands, push after push."""
    from weight_sync.interfaces import WeightSyncSettings

    _needs_two_gpus()
    torch.cuda.set_device(0)
    _push_check_generate(ws_toy_model, WeightSyncSettings(backend="nccl", bucket_bytes=32 * 1024, timeout_s=20),
                         "cuda:1", lambda scale: _weights(ws_toy_model, scale))


@pytest.mark.parametrize("load_format", ["flattened_bucket", "tensor"])
def test_tensor_transport_into_an_engine_on_the_same_gpu(ws_toy_model, load_format):  # noqa: F811
    """Colocated mode on one GPU: the trainer's tensors and one embedded engine on cuda:0. Each
    bucket travels as CUDA IPC handles (device named by UUID; the engine maps the trainer's memory,
    waits for the trainer's packing through the handle's event, copies, and answers once the copy
    is done, after which the trainer frees the bucket); every tensor lands bitwise, push after push,
    and the engine generates in between."""
    from weight_sync.interfaces import WeightSyncSettings

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.set_device(0)
    _push_check_generate(ws_toy_model, WeightSyncSettings(transport="tensor", load_format=load_format,
                                                          bucket_bytes=32 * 1024, timeout_s=20),
                         "cuda:0", lambda scale: _weights(ws_toy_model, scale))


@pytest.mark.parametrize("transport", ["tensor", "distributed"])
def test_fp32_trainer_into_a_bf16_engine_on_the_same_gpu(ws_toy_model, transport):  # noqa: F811
    """Issue 13: fp32 master weights on cuda:0 and an engine serving bf16 on cuda:0. Each bucket is
    cast on the GPU while it is packed (tensor: CUDA IPC handles; distributed: over gloo), half the
    bytes travel, and the engine holds the trainer's weights cast to bf16, bit for bit."""
    from embedded_engine.launch import launch_engine_process
    from embedded_engine.settings import EngineSettings
    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.set_device(0)
    es = [launch_engine_process(EngineSettings(model_path=str(ws_toy_model), port=0, device="cuda:0",
                                               dtype="bfloat16", max_running_requests=8), timeout_s=180)]
    url = es[0][1]
    s = WeightSyncSettings(transport=transport, backend="gloo", bucket_bytes=32 * 1024, timeout_s=20,
                           check_equal=True, load_format="flattened_bucket")
    try:
        with WeightSender(s) as sender:
            sender.connect([url])
            for version, scale in ((1, 1.25), (2, 0.5)):
                named = _weights(ws_toy_model, scale)
                m = sender.push(named, version=version)
                assert m["weight_sync/cast_tensors"] == len(named)
                assert m["weight_sync/bytes"] == sum(t.numel() * 2 for _, t in named)
                _generates(url)
                _assert_engine_holds(url, named, torch.bfloat16)
    finally:
        stop_engines(es)


def test_mapped_parameters_into_a_bf16_engine_on_the_same_gpu(ws_toy_model):  # noqa: F811
    """``mapped`` on one GPU: the trainer's fp32 parameters (changed in place between pushes, as an
    optimizer does) go as handles the engine holds; it casts to bf16 while copying. After each
    push: every tensor bitwise equal to the trainer's cast to bf16, and generation. Once the sender
    closes, the engine lets go: the trainer's memory is freed when it frees its parameters."""
    from embedded_engine.launch import launch_engine_process
    from embedded_engine.settings import EngineSettings
    from sglang_protocol.held_weights import LOADER
    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.set_device(0)
    es = [launch_engine_process(EngineSettings(model_path=str(ws_toy_model), port=0, device="cuda:0",
                                               dtype="bfloat16", max_running_requests=8,
                                               custom_weight_loader=LOADER), timeout_s=180)]
    url = es[0][1]
    base = torch.cuda.memory_allocated()
    params = [(n, torch.nn.Parameter(t.clone(), requires_grad=False)) for n, t in _weights(ws_toy_model, 1.0)]
    s = WeightSyncSettings(transport="tensor", load_format="mapped", timeout_s=20)
    try:
        with WeightSender(s) as sender:
            sender.connect([url])
            for version, scale in ((1, 1.25), (2, 0.5), (3, 0.75)):
                with torch.no_grad():
                    for _, p in params:
                        p.mul_(scale)
                m = sender.push(params, version=version)
                assert m["weight_sync/held_tensors"] == len(params) and m["weight_sync/num_buckets"] == 0
                assert _version(url) == str(version)
                _generates(url)
                _assert_engine_holds(url, params, torch.bfloat16)
        del params, p
        torch.cuda.ipc_collect()  # blocks another process held are freed once it let go
        assert torch.cuda.memory_allocated() <= base + (1 << 20)
    finally:
        stop_engines(es)


def _push_check_generate(model: Path, settings, device: str, weights) -> None:
    """Three pushes of other values (``weights(scale)``) into one engine on ``device``; after each:
    the version, a generation, and every tensor's checksum against the trainer's."""
    from weight_sync.sender import WeightSender

    es = [_engine(model, device=device)]
    url = es[0][1]
    try:
        with WeightSender(settings) as sender:
            sender.connect([url])
            for version, scale in ((1, 1.25), (2, 0.5), (3, 0.75)):
                named = weights(scale)
                m = sender.push(named, version=version)
                assert m["weight_sync/num_buckets"] > 2 and _version(url) == str(version)
                _generates(url)
                _assert_engine_holds(url, named)
    finally:
        stop_engines(es)


def _version(url: str) -> str:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{url}/model_info", timeout=30) as r:
        return json.loads(r.read())["weight_version"]


def _weights(model: Path, scale: float) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().to("cuda:0")) for n, p in perturbed_model(model, scale).named_parameters()]


def _needs_two_gpus() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


def test_nccl_push_lands_and_a_killed_engine_is_resynced(ws_toy_model):  # noqa: F811
    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    _needs_two_gpus()
    torch.cuda.set_device(0)
    es = [_engine(ws_toy_model)]
    url = es[0][1]
    s = WeightSyncSettings(backend="nccl", bucket_bytes=32 * 1024, check_equal=True, timeout_s=20, retries=1)
    try:
        with WeightSender(s) as sender:
            sender.connect([url])
            m = sender.push(_weights(ws_toy_model, 1.25), version=1)  # checksums compared inside
            assert m["weight_sync/num_buckets"] > 2 and _version(url) == "1"

            def kill_after_first(done: int, total: int) -> None:
                if done == 1 and es[0][0].poll() is None:
                    es[0][0].kill()
                    es[0][0].wait()

            t = time.monotonic()
            with pytest.raises(RuntimeError, match="push v2"):
                sender.push(_weights(ws_toy_model, 0.75), version=2, progress=kill_after_first)
            assert time.monotonic() - t < 6 * s.timeout_s  # bounded, not a hung NCCL kernel
            assert not sender.engine_status()[url]["alive"]
            es[0] = _engine(ws_toy_model, port=int(url.rsplit(":", 1)[1]))  # back at the same address
            w2 = _weights(ws_toy_model, 0.75)
            sender.resync(url, w2, version=2)
            assert _version(url) == "2" and sender.engine_status()[url]["alive"]
            m = sender.push(_weights(ws_toy_model, 0.5), version=3)
            assert m["weight_sync/attempts"] == 1 and _version(url) == "3"
    finally:
        stop_engines(es)


def test_nccl_stalled_engine_does_not_hang_the_trainer(ws_toy_model):  # noqa: F811
    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    _needs_two_gpus()
    torch.cuda.set_device(0)
    es = [_engine(ws_toy_model)]
    url = es[0][1]
    s = WeightSyncSettings(backend="nccl", bucket_bytes=32 * 1024, timeout_s=5.0, retries=1)
    try:
        with WeightSender(s) as sender:
            sender.connect([url])
            w = _weights(ws_toy_model, 1.1)

            def stop_after_first(done: int, total: int) -> None:
                if done == 1:
                    os.kill(es[0][0].pid, signal.SIGSTOP)  # alive but unresponsive

            t = time.monotonic()
            with pytest.raises(RuntimeError, match="push v1"):
                sender.push(w, version=1, progress=stop_after_first)
            assert time.monotonic() - t < 8 * s.timeout_s
            os.kill(es[0][0].pid, signal.SIGCONT)  # it answers again: the next push revives it
            m = sender.push(w, version=2)
            assert m["weight_sync/revived"] == 1 and _version(url) == "2"
    finally:
        stop_engines(es)


if __name__ == "__main__":
    import sys
    import tempfile

    from tests._fixtures_weight_sync import _make_toy_model_main

    path = Path(tempfile.mkdtemp()) / "model"
    _make_toy_model_main()(["--out", str(path), "--num-train", "10", "--num-eval", "4"])
    failed = 0
    for t in (test_nccl_push_lands_and_a_killed_engine_is_resynced, test_nccl_stalled_engine_does_not_hang_the_trainer):
        t0 = time.time()
        try:
            t(path)
            print(f"PASS {t.__name__} ({time.time() - t0:.1f}s)", flush=True)
        except BaseException as e:  # report and go on to the next test
            failed += 1
            print(f"FAIL {t.__name__} ({time.time() - t0:.1f}s): {type(e).__name__}: {e}", flush=True)
    sys.exit(1 if failed else 0)
