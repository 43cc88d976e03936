"""The embedded engine on CUDA (run on the GPU machine): the same runner/scheduler code with
``--device cuda``; fp32 greedy equals transformers' generate, log-probs equal a full forward,
seeded sampling does not depend on batch mates, bf16 runs; throughput vs generate at 64.

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
    from rollout_manager.engine.model_runner import ModelRunner
    from rollout_manager.engine.scheduler import Scheduler
    from rollout_manager.engine.settings import EngineSettings

    runner = ModelRunner(EngineSettings(model_path=str(model), device="cuda", dtype=dtype))
    return runner, Scheduler(runner, 128, 8192, 0, "v0")


def _generate(sched, prompts, params_list) -> list:
    from rollout_manager.engine.scheduler import Request

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
    from rollout_manager.engine.protocol import SamplingParams

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    runner, sched = _scheduler(engine_model, "float32")
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
    from rollout_manager.engine.protocol import SamplingParams

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    runner, sched = _scheduler(engine_model, "bfloat16")
    try:
        assert next(runner.model.parameters()).dtype == torch.bfloat16
        rs = _generate(sched, [[5, 6, 7]] * 8, [SamplingParams(max_new_tokens=16, ignore_eos=True)] * 8)
        assert all(len(r.output_ids) == 16 and all(x <= 0 for x in r.logprobs) for r in rs)
    finally:
        sched.stop()


if __name__ == "__main__":
    import sys
    import tempfile

    from _fixtures_engine import make_toy_model

    path = make_toy_model(Path(tempfile.mkdtemp()) / "model")
    for t in (test_cuda_fp32_matches_transformers_and_full_forward, test_cuda_bf16_generates):
        t0 = time.time()
        t(path)
        print(f"PASS {t.__name__} ({time.time() - t0:.1f}s)")
    sys.exit(0)
