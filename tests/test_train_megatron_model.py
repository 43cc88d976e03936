"""Megatron GPTModel vs HF: same logits and log-probs on the same weights (fp32, CPU, <= 1e-4) for
Llama / Qwen2 / Qwen3 on one rank, TP=2 and PP=2; export(load(checkpoint)) == checkpoint bit
for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._fixtures_megatron import ARCHS, check_layouts, make_hf_checkpoint, spawn

pytest.importorskip("megatron.core")

LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tp, pp) on 2 ranks: DP=2, TP=2, PP=2


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("megatron_ckpts")
    ckpts = {a: str(make_hf_checkpoint(a, root / a, seed=i)) for i, a in enumerate(ARCHS)}
    return spawn(check_layouts, 2, (ckpts, LAYOUTS), root / "ranks")


@pytest.mark.parametrize("layout", ["tp1pp1", "tp2pp1", "tp1pp2"])
def test_matches_hf(results: list[dict[str, Any]], layout: str) -> None:
    seen_logits = seen_export = 0
    for rank_res in results:
        for arch, r in rank_res[layout].items():
            if "logits" in r:
                seen_logits += 1
                assert r["logits"] <= 1e-4, f"{arch} {layout}: logits differ by {r['logits']}"
                assert r["logprobs"] <= 1e-4, f"{arch} {layout}: log-probs differ by {r['logprobs']}"
            if "export_equal" in r:
                seen_export += 1
                assert r["export_equal"] == 1.0, f"{arch} {layout}: export(load(ckpt)) != ckpt"
    assert seen_logits >= len(ARCHS) and seen_export == len(ARCHS)


def test_conversion_mistakes_are_caught(tmp_path: Path) -> None:
    """The comparison can fail: the llama3 rope scaling and the QKV interleave both matter."""
    import copy

    import torch

    from tests._fixtures_megatron import hf_config
    from train_backend.megatron import convert, model as mmodel

    cfg = hf_config("llama")
    plain = copy.deepcopy(cfg)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 50000.0}
    assert not torch.allclose(mmodel.hf_inv_freq(cfg), mmodel.hf_inv_freq(plain))
    dims = mmodel.dims_from_hf(cfg, 128, 1)
    q, k, v = (torch.randn(n * 16, 64) for n in (4, 2, 2))
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    fused = convert.hf_to_mcore(name, [q, k, v], dims)
    assert not torch.equal(fused, torch.cat([q, k, v]))  # interleaved per KV group, not stacked
    back = dict(convert.mcore_to_hf(name, fused, dims))
    assert torch.equal(back["model.layers.0.self_attn.k_proj.weight"], k)
    # TP shards of the fused gate/up hold [gate_r; up_r], and unshard inverts them
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    full = torch.randn(2 * 96, 64)
    shards = [convert.tp_shard(fc1, full, r, 2) for r in range(2)]
    assert torch.equal(shards[0][:48], full[:48]) and torch.equal(shards[0][48:], full[96:144])
    assert torch.equal(convert.tp_unshard(fc1, shards), full)


def test_unsupported_configs_are_rejected() -> None:
    from tests._fixtures_megatron import hf_config
    from train_backend.megatron import model as mmodel

    gelu = hf_config("llama")
    gelu.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act"):
        mmodel.dims_from_hf(gelu, 128, 1)
    yarn = hf_config("llama")
    yarn.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 128}
    with pytest.raises(ValueError, match="rope_type"):
        mmodel.hf_inv_freq(yarn)
    assert mmodel.padded_vocab(100, 128, 2) == 256 and mmodel.padded_vocab(256, 128, 2) == 256


@pytest.mark.parametrize("backend", ["auto", "flash", "cudnn", "efficient"])
def test_sdpa_attention_matches_naive_causal_attention(backend: str) -> None:
    """Core attention = softmax(QK^T/sqrt(d) + causal mask) V with GQA; packed segments attend
    only within themselves; with any --sdpa-backend priority (on the CPU: the kernels it has)."""
    from types import SimpleNamespace

    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from train_backend.megatron.attention import SDPAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                            attention_dropout=0.0)
    attn = SDPAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1)),
                        backend=backend)
    torch.manual_seed(0)
    s, b = 10, 2
    q = torch.randn(s, b, 4, 16)  # [s, b, np, hn]
    k, v = torch.randn(s, b, 2, 16), torch.randn(s, b, 2, 16)  # [s, b, ng, hn]

    def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)  # [s, b, np, hn]
        scores = torch.einsum("sbhd,tbhd->bhst", q, kk) / 4.0  # [b, np, s, s]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vv).reshape(n, q.shape[1], -1)  # [s, b, np*hn]

    assert torch.allclose(attn(q, k, v, None), naive(q, k, v), atol=1e-5)
    packed = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 4, 9]), cu_seqlens_kv=torch.tensor([0, 4, 9]))
    out = attn(q[:, :1], k[:, :1], v[:, :1], None, packed_seq_params=packed)  # [s, 1, np*hn]
    assert torch.allclose(out[:4], naive(q[:4, :1], k[:4, :1], v[:4, :1]), atol=1e-5)
    assert torch.allclose(out[4:9], naive(q[4:9, :1], k[4:9, :1], v[4:9, :1]), atol=1e-5)
    assert out.shape == (s, 1, 64)


def test_cpu_compat_maps_cuda_to_cpu_and_is_undone() -> None:
    """Inside cpu_mode megatron's CUDA calls land on the CPU; outside it nothing is changed."""
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    from train_backend.megatron import cpu_compat

    before = (torch.cuda.current_device, mrandom.CudaRNGStatesTracker.fork)
    with cpu_compat.cpu_mode():
        x = torch.zeros(3, device="cuda")
        y = torch.ones(2, device=torch.cuda.current_device()).cuda().to(torch.cuda.current_device())
        assert x.device.type == "cpu" and y.device.type == "cpu"
        assert x.type() == "torch.cuda.FloatTensor"  # megatron's optimizer asserts on this name
        tracker = mrandom.CudaRNGStatesTracker()
        tracker.add("t", 123)
        with tracker.fork("t"):
            a = torch.rand(2)
        with tracker.fork("t"):
            b = torch.rand(2)
        assert not torch.equal(a, b)  # the forked generator advanced
    assert (torch.cuda.current_device, mrandom.CudaRNGStatesTracker.fork) == before
    assert torch.zeros(1).type() == "torch.FloatTensor"
