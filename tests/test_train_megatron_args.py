"""Flags of the Megatron backend: defaults from the settings dataclass, validation naming flags."""

from __future__ import annotations

import argparse

import pytest

from train_backend.megatron.arguments import MegatronSettings, add_arguments, settings_from_args


def _parse(*argv: str) -> MegatronSettings:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return settings_from_args(p.parse_args(list(argv)))


def test_defaults_come_from_the_dataclass() -> None:
    assert _parse() == MegatronSettings()


def test_flags_reach_the_settings() -> None:
    s = _parse("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4", "--sequence-parallel",
               "--use-distributed-optimizer", "--make-vocab-size-divisible-by", "64", "--recompute-activations",
               "--transformer-impl", "local", "--loss-head", "compiled", "--bias-swiglu-fusion",
               "--torch-compile", "--sdpa-backend", "cudnn", "--fused-adam")
    assert s == MegatronSettings(2, 4, True, True, 64, True, "local", "compiled", True, True, "cudnn", True)


def test_auto_choices_are_made_per_device() -> None:
    d = MegatronSettings()
    cuda, cpu = d.for_device("cuda"), d.for_device("cpu")
    assert (cuda.loss_head, cuda.bias_swiglu_fusion, cuda.torch_compile) == ("compiled", True, True)
    assert (cpu.loss_head, cpu.bias_swiglu_fusion, cpu.torch_compile) == ("chunked", False, False)
    off = _parse("--no-bias-swiglu-fusion", "--no-torch-compile", "--loss-head", "unfused").for_device("cuda")
    assert (off.loss_head, off.bias_swiglu_fusion, off.torch_compile) == ("unfused", False, False)


@pytest.mark.parametrize("argv, flag", [
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size"),
    (["--pipeline-model-parallel-size", "0"], "--pipeline-model-parallel-size"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by"),
    (["--sequence-parallel"], "--sequence-parallel"),
])
def test_bad_values_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        _parse(*argv)


def test_bad_loss_head_names_the_flag() -> None:
    with pytest.raises(ValueError, match="loss_head"):
        MegatronSettings(loss_head="fused")
    with pytest.raises(SystemExit):  # argparse refuses it before the dataclass sees it
        _parse("--loss-head", "fused")
    with pytest.raises(ValueError, match="sdpa_backend"):
        MegatronSettings(sdpa_backend="fa3")


def test_sdpa_backend_names_agree() -> None:
    pytest.importorskip("megatron.core")
    from train_backend.megatron import arguments, attention

    assert arguments.SDPA_BACKENDS == attention.SDPA_BACKENDS


def test_fuse_adam_switches_the_inner_torch_optimizer() -> None:
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace

    import torch

    from train_backend.megatron.backend import _fuse_adam

    p = torch.nn.Parameter(torch.randn(4))
    wrapped = SimpleNamespace(optimizer=torch.optim.AdamW([p], lr=0.1))
    _fuse_adam(SimpleNamespace(chained_optimizers=[wrapped]))
    assert all(g["fused"] and g["foreach"] is False for g in wrapped.optimizer.param_groups)
    p.grad = torch.ones(4)
    wrapped.optimizer.step()  # runs torch's fused kernel (it has a CPU one)
    with pytest.raises(ValueError, match="--fused-adam"):
        _fuse_adam(SimpleNamespace(optimizer=torch.optim.SGD([p], lr=0.1)))
