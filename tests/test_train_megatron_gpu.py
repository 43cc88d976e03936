"""The Megatron backend on CUDA (NCCL): HF equivalence (fp32, TF32 off) and training that matches
the torch backend, with TP=2 / PP=2 / DP=2 when two GPUs are present. Run on the GPU machine:
``pytest -m gpu tests/test_train_megatron_gpu.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._fixtures_megatron import (ARCHS, check_layouts, make_groups, make_hf_checkpoint, run_layouts, spawn,
                                      train_settings)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("megatron.core")


def _gpus() -> int:
    return min(2, torch.cuda.device_count())


def test_gpu_matches_hf(tmp_path: Path) -> None:
    ckpts = {a: str(make_hf_checkpoint(a, tmp_path / a, seed=i)) for i, a in enumerate(ARCHS)}
    layouts = [(1, 1)] + ([(2, 1), (1, 2)] if _gpus() == 2 else [])
    results = spawn(check_layouts, _gpus(), (ckpts, layouts, "cuda"), tmp_path / "ranks")
    for layout in (f"tp{t}pp{p}" for t, p in layouts):
        for rank_res in results:
            for arch, r in rank_res[layout].items():
                if "logits" in r:
                    assert r["logits"] <= 1e-4 and r["logprobs"] <= 1e-4, f"{arch} {layout}: {r}"
                if "export_equal" in r:
                    assert r["export_equal"] == 1.0, f"{arch} {layout}: export(load(ckpt)) != ckpt"


def test_gpu_training_matches_torch_backend(toy_model_dir: Path, tmp_path: Path) -> None:
    from train_backend.torch_backend import TorchBackend

    torch.backends.cuda.matmul.allow_tf32 = False
    ckpt = str(toy_model_dir)
    tb = TorchBackend(train_settings(ckpt, device="cuda"))
    ref = [tb.train_step(make_groups(step), step) for step in range(2)]
    ref_w = {k: v.detach().float().cpu() for k, v in tb.named_hf_weights()}
    layouts = [{}] if _gpus() == 1 else [{"tensor_model_parallel_size": 2}, {"pipeline_model_parallel_size": 2},
                                          {"use_distributed_optimizer": True}]
    jobs = [{"megatron_kw": kw, "steps": 2, "settings_kw": {"device": "cuda"}} for kw in layouts]
    got: list[dict[str, Any]] = spawn(run_layouts, _gpus(), (ckpt, jobs), tmp_path / "ranks")[0]
    for kw, g in zip(layouts, got):
        for a, b in zip(ref, g["metrics"]):
            assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-3, abs=1e-4), kw
            assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-3), kw
        diff = max((g["weights"][k].float().cpu() - ref_w[k]).abs().max().item() for k in ref_w)
        assert diff < 1e-4, f"{kw}: weights differ by {diff}"
