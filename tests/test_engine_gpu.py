"""The embedded engine on CUDA (run on the GPU machine): the same runner/scheduler code with
``--device cuda``; fp32 greedy equals transformers' generate, log-probs equal a full forward,
seeded sampling does not depend on batch mates, bf16 runs; the native forward equals the runner
on transformers' modules (fp32 and bf16) and prints both decode step times.

    pytest -m gpu tests/test_engine_gpu.py      (or: python tests/test_engine_gpu.py)
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from _fixtures_engine import engine_model, hf_model, reference_logprobs  # noqa: F401

pytestmark = pytest.mark.gpu


def _scheduler(model: Path, dtype: str):
    from embedded_engine.model_runner import ModelRunner
    from embedded_engine.scheduler import Scheduler
    from embedded_engine.settings import EngineSettings

    runner = ModelRunner(EngineSettings(model_path=str(model), device="cuda", dtype=dtype))
    return runner, Scheduler(runner, 128, 8192, 0, "v0")


def _generate(sched, prompts, params_list) -> list:
    from embedded_engine.scheduler import Request

    done = threading.Semaphore(0)
    reqs = [Request(f"g{i}-{time.monotonic_ns()}", p, sp, lambda r: done.release())
            for i, (p, sp) in enumerate(zip(prompts, params_list))]
    for r in reqs:
        sched.submit(r)
    for _ in reqs:
        assert done.acquire(timeout=120)
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    return reqs


def test_cuda_fp32_matches_transformers_and_full_forward(engine_model):
    from embedded_engine.protocol import SamplingParams

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    runner, sched = _scheduler(engine_model, "float32")
    assert runner.native is not None  # the toy llama runs the engine's native forward
    try:
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(7, 90, (int(n),), generator=g).tolist() for n in torch.randint(2, 12, (6,), generator=g)]
        greedy = _generate(sched, prompts, [SamplingParams(temperature=0.0, max_new_tokens=20)] * 6)
        model = hf_model(engine_model).cuda()
        for p, r in zip(prompts, greedy):
            ref = model.generate(torch.tensor([p], device="cuda"), attention_mask=torch.ones(1, len(p), dtype=torch.long,
                                 device="cuda"), do_sample=False, max_new_tokens=20)[0, len(p):].tolist()
            assert r.output_ids == ref
        sampled = _generate(sched, prompts, [SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=20,
                                                            ignore_eos=True, sampling_seed=i) for i in range(6)])
        cpu_model = model.float().cpu()
        for p, r in zip(prompts, sampled):
            ref = reference_logprobs(cpu_model, p, r.output_ids, 0.7)
            assert max(abs(a - b) for a, b in zip(ref, r.logprobs)) <= 1e-4
        alone = _generate(sched, [prompts[0]], [SamplingParams(max_new_tokens=30, ignore_eos=True, sampling_seed=9)])
        crowd = _generate(sched, prompts, [SamplingParams(max_new_tokens=30, ignore_eos=True, sampling_seed=9)] +
                          [SamplingParams(max_new_tokens=25, temperature=0.8)] * 5)
        assert alone[0].output_ids == crowd[0].output_ids
    finally:
        sched.stop()


def test_cuda_bf16_generates(engine_model):
    from embedded_engine.protocol import SamplingParams

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    runner, sched = _scheduler(engine_model, "bfloat16")
    try:
        assert next(runner.model.parameters()).dtype == torch.bfloat16
        rs = _generate(sched, [[5, 6, 7]] * 8, [SamplingParams(max_new_tokens=16, ignore_eos=True)] * 8)
        assert all(len(r.output_ids) == 16 and all(x <= 0 for x in r.logprobs) for r in rs)
    finally:
        sched.stop()


def _decode_steps(runner, prompts, steps: int) -> tuple[list[torch.Tensor], float]:
    """Prefill + greedy decode; returns (logits of each step [B, V] on the CPU, ms per decode step)."""
    out = []
    with torch.inference_mode():
        logits, batch = runner.prefill(prompts)
        out.append(logits.float().cpu())
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            batch.last_tok = logits.argmax(-1)
            logits = runner.decode(batch)
            out.append(logits.float().cpu())
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t) / steps * 1e3


@pytest.mark.parametrize("name", ["llama_gqa_untied", "qwen2_bias_tied", "qwen3_qk_norm_head_dim"])
def test_cuda_native_forward_equals_transformers_path(engine_model, tmp_path, name):
    """The native forward on CUDA against the same runner on transformers' modules: fp32 (no
    TF32) to 1e-4 through prefill and decode; bf16 close (log-probs within 0.1); step times."""
    from embedded_engine.model_runner import ModelRunner
    from embedded_engine.settings import EngineSettings
    from test_engine_native import _build

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path = _build(name, tmp_path, engine_model)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(7, 95, (int(n),), generator=g).tolist() for n in torch.randint(1, 20, (64,), generator=g)]
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 0.1)):
        runs = {}
        for mode in ("auto", "off"):
            r = ModelRunner(EngineSettings(model_path=str(path), device="cuda", dtype=dtype, native_forward=mode))
            assert (r.native is not None) == (mode == "auto")
            _decode_steps(r, prompts, 3)  # warm-up
            runs[mode] = _decode_steps(r, prompts, 8)
        (nat, ms_nat), (hf, ms_hf) = runs["auto"], runs["off"]
        print(f"{name} {dtype}: decode step at 64 rows {ms_nat:.2f} ms native vs {ms_hf:.2f} ms transformers")
        # greedy paths may split where two logits tie within round-off: compare until the first split
        for a, b in zip(nat, hf):
            diff = (torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs().max().item()
            assert diff <= tol, (dtype, diff)
            if not torch.equal(a.argmax(-1), b.argmax(-1)):
                break


if __name__ == "__main__":
    import sys
    import tempfile

    from _fixtures_engine import make_toy_model

    path = make_toy_model(Path(tempfile.mkdtemp()) / "model")
    for t in (test_cuda_fp32_matches_transformers_and_full_forward, test_cuda_bf16_generates):
        t0 = time.time()
        t(path)
        print(f"PASS {t.__name__} ({time.time() - t0:.1f}s)")
    for name in ("llama_gqa_untied", "qwen2_bias_tied", "qwen3_qk_norm_head_dim"):
        t0 = time.time()
        test_cuda_native_forward_equals_transformers_path(path, Path(tempfile.mkdtemp()), name)
        print(f"PASS test_cuda_native_forward_equals_transformers_path[{name}] ({time.time() - t0:.1f}s)")
    sys.exit(0)
