"""The real-SGLang GPU tier: a real SGLang server (its kernels, its loaders, its memory saver) on
the GPU machine, driven by Reservoir's own code. Not in CPU CI (marker ``sglang``).

    bash scripts/run_sglang_tier.sh         # on the GPU machine, from the repository root

- pushes in every ``tensor``-transport load format and every pause mode while requests are in
  flight; every tensor read back through SGLang's ``/get_weights_by_name`` equals the trainer's
  cast (vocabulary padding left out), and ``--check-weight-update-equal``'s read-back fails on a
  tensor that differs;
- ``WeightSender.connect`` without GPU counts reads them from ``/server_info``;
- delta pushes (``--update-weight-mode delta``, both encodings) through SGLang's own disk loader
  land exactly;
- LoRA adapter pushes (``--lora-rank``, CUDA IPC and from disk): SGLang serves the trainer's adapter
  (its log-probs read back against peft's);
- KV cache release and resume around a training step (``EngineMemory``): the GPU's free memory
  grows and shrinks by the cache, generation works after;
- the launcher colocated with the torch trainer (CUDA graphs on, ``--sglang-*`` passed through,
  every push checked), losing its only SGLang engine mid-run: restarted and re-synced before it
  serves, every group trained once, eval rises; and with the Megatron trainer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from _fixtures_engine import reference_logprobs
from _fixtures_sglang import LAUNCHER_FLAGS, ROOT, sglang_available, start_sglang, stop_sglang

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900),  # SGLang's start-up: 50-120 s each
              pytest.mark.skipif(not sglang_available(), reason="needs a CUDA GPU and SGLang (the GPU machine)")]


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    from scripts import make_toy_model

    # the example's warm-up (60 steps): with 20, eval stayed at 0.094 for 12 steps with either engine (2026-12-03)
    return make_toy_model.main(["--out", str(tmp_path_factory.mktemp("sgl") / "model"), "--warmup-steps", "60"])


@pytest.fixture(scope="module")
def server(toy, tmp_path_factory):
    """One SGLang server on the toy model, bf16, colocated settings (memory saver, the held-weights
    loader allowed, a small static memory fraction), CUDA graphs off (the launcher test has them)."""
    from sglang_protocol.net import free_port
    from sglang_protocol.held_weights import LOADER

    port = free_port()
    log = tmp_path_factory.mktemp("sgl-log") / "server.log"
    proc = start_sglang(toy, port, "--dtype", "bfloat16", "--mem-fraction-static", "0.2", "--enable-memory-saver",
                        "--custom-weight-loader", LOADER, "--disable-cuda-graph", log=log)
    yield f"http://127.0.0.1:{port}"
    stop_sglang(proc)
    print(log.read_text()[-2000:])


def _post(url: str, path: str, body: dict, timeout: float = 120) -> object:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _trainer_weights(toy: Path, scale: float) -> list[tuple[str, torch.nn.Parameter]]:
    """The toy model's parameters on the GPU in fp32 (the trainer's master weights), scaled, so each
    push carries values the server does not hold yet."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(toy), torch_dtype=torch.float32).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return list(model.named_parameters())


def _read_back_equal(url: str, named, dtype: torch.dtype) -> list[str]:
    """Names whose every row SGLang holds (read back in full) differs from the trainer's cast; a
    vocabulary SGLang padded comes back with extra rows, which are not compared."""
    bad = []
    for name, t in named:
        got = torch.tensor(_post(url, "/get_weights_by_name", {"name": name, "truncate_size": t.shape[0]}))
        want = t.detach().to(dtype).float().cpu()
        if got.shape[0] < want.shape[0] or not torch.equal(got[:want.shape[0]], want):
            bad.append(name)
    return bad


class _InFlight:
    """Generation requests kept in flight (long, ignore_eos) while a push runs; each answer counted."""

    def __init__(self, url: str, n: int = 16):
        self.answers: list[dict] = []
        self.errors: list[str] = []
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 200, "temperature": 1.0,
                                                                "ignore_eos": True}}

        def one() -> None:
            try:
                self.answers.append(_post(url, "/generate", body, timeout=300))
            except Exception as e:  # noqa: BLE001 - counted and asserted on
                self.errors.append(f"{type(e).__name__}: {e}")
        self.threads = [threading.Thread(target=one) for _ in range(n)]
        for t in self.threads:
            t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=300)


@pytest.mark.parametrize("pause_mode", ["abort", "retract", "in_place"])
@pytest.mark.parametrize("load_format", ["flattened_bucket", "tensor", "mapped"])
def test_push_lands_exactly_while_requests_are_in_flight(server, toy, load_format, pause_mode):
    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    scale = 1.0 + 0.01 * (hash((load_format, pause_mode)) % 50 + 1)
    named = _trainer_weights(toy, scale)
    s = WeightSyncSettings(transport="tensor", load_format=load_format, pause_mode=pause_mode, timeout_s=120,
                           engine_dtype="bfloat16", check_equal=True, bucket_bytes=4 << 20)
    flight = _InFlight(server)
    time.sleep(0.5)  # the requests reach the scheduler: the push pauses a busy engine
    with WeightSender(s) as sender:
        sender.connect([server])  # no GPU counts: read from /server_info
        assert sender.engines[0].gpus == 1 and sender.engines[0].check == "readback"
        m = sender.push(named, version=7)
        flight.join()
        assert m["weight_sync/check_s"] > 0 and m["weight_sync/attempts"] == 1
        assert not flight.errors, flight.errors[:3]
        assert len(flight.answers) == 16
        if pause_mode == "abort":  # aborted requests come back with what they had (partial rollout resumes them)
            assert any(a["meta_info"]["finish_reason"]["type"] == "abort" for a in flight.answers) or \
                all(a["meta_info"]["completion_tokens"] == 200 for a in flight.answers)
        else:  # kept across the push: each finishes its 200 tokens (the toy model has 256 positions)
            assert all(a["meta_info"]["completion_tokens"] == 200 for a in flight.answers), \
                [a["meta_info"]["finish_reason"] for a in flight.answers][:4]
        assert _read_back_equal(server, named, torch.bfloat16) == []
        assert sender._loop.run(sender.engines[0].client.get_weight_version(), timeout=60) == "7"


def test_the_read_back_check_fails_on_a_differing_tensor(server, toy):
    """``--check-weight-update-equal`` against real SGLang can fail: one element changed after the
    push is found and named."""
    from weight_sync.engines import check_equal
    from weight_sync.interfaces import TensorSpec, WeightSyncSettings
    from weight_sync.sender import WeightSender

    named = _trainer_weights(toy, 0.97)
    with WeightSender(WeightSyncSettings(transport="tensor", load_format="flattened_bucket", timeout_s=120,
                                         engine_dtype="bfloat16", check_equal=True)) as sender:
        sender.connect([server])
        sender.push(named, version=8)
        name, t = named[3]
        with torch.no_grad():
            t.view(-1)[0] += 1.0
        sent = [TensorSpec(n, tuple(x.shape), "bfloat16") for n, x in named]
        with pytest.raises(RuntimeError, match=f"weight {name!r} differs"):
            sender._loop.run(check_equal(sender.engines, named, 120.0, sent), timeout=300)


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_delta_push_lands_exactly_through_sglangs_own_loader(server, toy, tmp_path, encoding):
    """``--update-weight-mode delta`` into real SGLang (disk transport: ``/update_weights_from_disk``,
    SGLang's own loader feeding its model's ``load_weights``, which the held-weights loader armed):
    a full push, then a training-like step changing ~2% of the elements goes as a delta, far fewer
    bytes, and every tensor read back equals the trainer's cast."""
    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    named = _trainer_weights(toy, 1.03 if encoding == "xor" else 0.98)
    s = WeightSyncSettings(transport="disk", update_mode="delta", delta_encoding=encoding, full_every=0,
                           disk_dir=str(tmp_path / "disk"), hf_checkpoint=str(toy), engine_dtype="bfloat16",
                           check_equal=True, timeout_s=120)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with WeightSender(s) as sender:
        sender.connect([server])
        first = sender.push(named, version=20)
        assert first["weight_sync/delta"] == 0
        with torch.no_grad():
            for _, t in named:
                changed = torch.rand(t.shape, generator=gen, device=t.device) < 0.02
                t.add_(changed * t.abs().clamp_min(1e-3) * 0.05)
        m = sender.push(named, version=21)
    assert m["weight_sync/delta"] == 1 and m["weight_sync/attempts"] == 1 and m["weight_sync/check_s"] > 0
    assert m["weight_sync/sent_bytes"] < m["weight_sync/bytes"] / 4, m
    assert _read_back_equal(server, named, torch.bfloat16) == []
    print(f"delta {encoding}: {m['weight_sync/bytes']} -> {m['weight_sync/sent_bytes']} bytes, "
          f"{m['weight_sync/time_s']:.3f} s (full {first['weight_sync/time_s']:.3f} s)")


@pytest.fixture(scope="module")
def lora_server(toy, tmp_path_factory):
    """One SGLang server on the toy model serving LoRA adapters (``--enable-lora``, rank up to 8, every
    linear layer), bf16, CUDA graphs off."""
    from sglang_protocol.net import free_port

    port = free_port()
    log = tmp_path_factory.mktemp("sgl-lora-log") / "server.log"
    proc = start_sglang(toy, port, "--dtype", "bfloat16", "--mem-fraction-static", "0.2", "--enable-lora",
                        "--max-lora-rank", "8", "--lora-target-modules", "all", "--disable-cuda-graph", log=log)
    yield f"http://127.0.0.1:{port}"
    stop_sglang(proc)
    print(log.read_text()[-2000:])


def _served(url: str, prompt: list[int], lora_path: str | None, n: int = 24) -> tuple[list[int], torch.Tensor, dict]:
    """``n`` greedy tokens SGLang generates after ``prompt`` (naming ``lora_path``): their ids, the
    log-probs it reports for them, and the answer's meta_info."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True}
    if lora_path:
        body["lora_path"] = lora_path
    out = _post(url, "/generate", body)
    meta = out["meta_info"]
    return out["output_ids"], torch.tensor([lp for lp, *_ in meta["output_token_logprobs"]]), meta


@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_lora_adapter_push_serves_the_trainers_adapter(lora_server, toy, tmp_path, transport):
    """``push_adapter`` (what ``--lora-rank`` pushes after each step) into real SGLang: colocated as
    CUDA IPC handles (``/load_lora_adapter_from_tensors``) or from a peft directory
    (``/load_lora_adapter``). Read back through the engine: the log-probs SGLang reports for what it generates under
    the adapter's name equal the trainer's peft model's (within bf16's error), far from the base
    model's; a second push replaces the adapter, the weight version follows each push, and requests
    without the adapter's name still get the base model."""
    from transformers import AutoModelForCausalLM

    from sglang_protocol.lora_adapter import POLICY_ADAPTER
    from train_backend.lora import LoraSettings, adapter_config, adapter_tensors, wrap
    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    prompt = [1, 5, 6, 7, 8, 9]
    model = wrap(AutoModelForCausalLM.from_pretrained(str(toy), torch_dtype=torch.float32).cuda(),
                 LoraSettings(rank=8, alpha=16.0, target_modules="all-linear"))
    base_out, sgl_base, _ = _served(lora_server, prompt, None)
    with model.disable_adapter():
        hf_base = torch.tensor(reference_logprobs(model, prompt, base_out, 1.0))
    s = WeightSyncSettings(transport=transport, timeout_s=120, disk_dir=str(tmp_path / "adapters"),
                           hf_checkpoint=str(toy))
    rows = []
    with WeightSender(s) as sender:
        sender.connect([lora_server])
        for version, seed in ((30, 0), (31, 1)):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            with torch.no_grad():  # a trained adapter: B is no longer zero
                for name, p in model.named_parameters():
                    if "lora_" in name:
                        p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * 0.2)
            m = sender.push_adapter(adapter_config(model, str(toy)), adapter_tensors(model), version)
            out, sgl_lora, meta = _served(lora_server, prompt, POLICY_ADAPTER)
            hf_lora = torch.tensor(reference_logprobs(model, prompt, out, 1.0))
            with model.disable_adapter():
                hf_base_on_out = torch.tensor(reference_logprobs(model, prompt, out, 1.0))
            row = {"version": version, "push_s": m["weight_sync/time_s"], "bytes": m["weight_sync/bytes"],
                   "served_vs_trainer": float((sgl_lora - hf_lora).abs().max()),
                   "served_vs_base": float((sgl_lora - hf_base_on_out).abs().max()),
                   "base_served_vs_trainer": float((sgl_base - hf_base).abs().max()),
                   "weight_version": meta.get("weight_version")}
            rows.append(row)
            print(f"lora {transport}: {row}")
            assert m["weight_sync/adapter"] == 1 and m["weight_sync/attempts"] == 1
            assert row["served_vs_trainer"] < 0.1 and row["base_served_vs_trainer"] < 0.1, row
            assert row["served_vs_base"] > 1.0 and row["served_vs_base"] > 10 * row["served_vs_trainer"], row
            assert sender._loop.run(sender.engines[0].client.get_weight_version(), timeout=60) == str(version)
    # the base model is still served without the adapter's name
    assert _served(lora_server, prompt, None)[0] == base_out
    if os.environ.get("RESERVOIR_TIER_OUT"):
        Path(os.environ["RESERVOIR_TIER_OUT"], f"lora_push_{transport}.json").write_text(json.dumps(rows, indent=2))


def test_kv_cache_release_and_resume_around_training(server):
    from weight_sync.engines import EngineMemory
    from weight_sync.interfaces import WeightSyncSettings

    memory = EngineMemory([server], WeightSyncSettings(timeout_s=120))
    free0 = torch.cuda.mem_get_info()[0]
    memory.release()
    free1 = torch.cuda.mem_get_info()[0]
    memory.resume()
    free2 = torch.cuda.mem_get_info()[0]
    print(f"GPU free: {free0 / 2**30:.2f} -> released {free1 / 2**30:.2f} -> resumed {free2 / 2**30:.2f} GiB")
    assert free1 - free0 > 2 ** 30  # the KV cache (0.2 of the GPU, less the weights) came back to the GPU
    assert free1 - free2 > 2 ** 30  # and went to the engine again
    out = _post(server, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8,
                                                                                     "ignore_eos": True}})
    assert out["meta_info"]["completion_tokens"] == 8


def _launch(toy: Path, out: Path, *extra: str, env: dict | None = None, timeout: float = 560,
            engine: str = "sglang") -> tuple[list[dict], str]:
    config = out.parent / f"{out.name}.yaml"  # the example's, without TensorBoard (not needed here)
    config.write_text((ROOT / "examples/gpu/grpo_colocate_1gpu.yaml").read_text()
                      .replace("use-tensorboard: true", "use-tensorboard: false"))
    cmd = [sys.executable, str(ROOT / "scripts/train.py"), "--config", str(config),
           "--hf-checkpoint", str(toy), "--prompt-data", str(toy / "data/train.jsonl"),
           "--eval-prompt-data", str(toy / "data/eval.jsonl"), "--no-build-toy-model", "--no-plots",
           "--output-dir", str(out), "--buffer-name", f"buf-{out.name}",
           *(("--rollout-engine", "sglang", *LAUNCHER_FLAGS, "--sglang-mem-fraction-static", "0.3")
             if engine == "sglang" else ()), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    text = proc.stdout + proc.stderr
    print(text[-4000:])
    assert proc.returncode == 0, text[-6000:]
    return [json.loads(line) for line in open(out / "metrics.jsonl")], text


def _evals(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}


def _record(name: str, records: list[dict], wall_s: float) -> None:
    """Each launcher run's eval curve and step-time medians, printed and, with ``RESERVOIR_TIER_OUT``
    set (a folder), written there as ``<name>.json`` (what bench/results/e2e_sglang.json records)."""
    import statistics

    steps = [r for r in records if "train/loss" in r][1:]  # step 0 includes first-use JIT
    keys = ("perf/step_time", "perf/rollout_time", "perf/train_time", "perf/weight_sync_time",
            "perf/release_memory_time", "perf/resume_memory_time", "weight_sync/time_s", "weight_sync/check_s")
    out = {"eval": _evals(records), "wall_s": wall_s, "steps": len(steps) + 1,
           "median": {k: statistics.median(r[k] for r in steps) for k in keys if all(k in r for r in steps)}}
    print(name, json.dumps(out))
    if os.environ.get("RESERVOIR_TIER_OUT"):
        Path(os.environ["RESERVOIR_TIER_OUT"], f"{name}.json").write_text(json.dumps(out, indent=2))


def test_launcher_colocated_torch_loses_its_only_engine(toy, tmp_path):
    """The launcher as a user runs it on one GPU with real SGLang (CUDA graphs on): every push read
    back and checked; SGLang SIGKILLed after step 4 trained: the push waits for the restart, the
    restarted server gets the weights before it serves; every group trained once; eval rises."""
    from buffer.arrow import read_parquet

    out = tmp_path / "torch"
    steps_n = 20
    t0 = time.monotonic()
    records, text = _launch(toy, out, "--num-rollout", str(steps_n), "--eval-interval", "10",
                            "--check-weight-update-equal", "--health-check-interval", "1",
                            "--save-debug-rollout-data", str(out / "dump_{rollout_id}.parquet"),
                            env={"RESERVOIR_CRASH_AT": "engine@after_train:4"})
    print(f"wall {time.monotonic() - t0:.0f}s")
    assert "no live engine; waiting" in text and "was restarted while its memory was released" in text
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(steps_n))
    assert all(r["weight_sync/check_s"] > 0 for r in steps)
    assert steps[4]["weight_sync/revived"] == 1
    assert all(r["rollout/weight_version_min"] == r["rollout/weight_version_max"] == r["step"] for r in steps)
    trained = [g[0].group_index for k in range(steps_n) for g in read_parquet(out / f"dump_{k}.parquet")]
    assert sorted(trained) == list(range(steps_n * 16))
    _record("launcher_torch_sglang", records, time.monotonic() - t0)
    ev = _evals(records)
    assert ev[steps_n] > ev[0], ev


def test_launcher_colocated_megatron(toy, tmp_path):
    """The launcher colocated with the Megatron trainer and real SGLang, every push checked; 20 steps
    as the torch test (12 steps on a 64-prompt greedy eval were within its noise: 0.34 -> 0.33 once)."""
    steps_n = 20
    t0 = time.monotonic()
    records, _ = _launch(toy, tmp_path / "megatron", "--train-backend", "megatron", "--num-rollout", str(steps_n),
                         "--eval-interval", "10", "--check-weight-update-equal")
    _record("launcher_megatron_sglang", records, time.monotonic() - t0)
    ev = _evals(records)
    assert ev[steps_n] > ev[0], ev


def test_launcher_colocated_torch_embedded_reference(toy, tmp_path):
    """The same run with the embedded engine (no loss), for the step-time split beside SGLang's
    (bench/results/e2e_sglang.json)."""
    t0 = time.monotonic()
    records, _ = _launch(toy, tmp_path / "embedded", "--num-rollout", "12", "--eval-interval", "6",
                         "--check-weight-update-equal", engine="embedded")
    _record("launcher_torch_embedded", records, time.monotonic() - t0)
