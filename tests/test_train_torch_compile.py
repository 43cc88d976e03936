"""TorchBackend(compile_layers=True) (torch.compile of each decoder layer; Inductor's C++ kernels
on the CPU) trains like the eager backend."""

from __future__ import annotations

import pytest
import torch

from tests._fixtures_megatron import make_groups, train_settings


@pytest.mark.slow
def test_compiled_layers_train_like_eager(toy_model_dir) -> None:
    from train_backend.torch_backend import TorchBackend

    out = []
    for compiled in (False, True):
        b = TorchBackend(train_settings(str(toy_model_dir)), compile_layers=compiled)
        metrics = [b.train_step(make_groups(step), step) for step in range(2)]
        out.append((metrics, {k: v.detach().clone() for k, v in b.named_hf_weights()}))
    (m_eager, w_eager), (m_comp, w_comp) = out
    for a, c in zip(m_eager, m_comp):
        assert c["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4, abs=1e-6)
        assert c["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
    assert max((w_comp[k] - w_eager[k]).abs().max().item() for k in w_eager) < 2e-5
