"""Held pushes replay the load they recorded (``sglang_protocol/load_replay.py``): against SGLang
0.5.23's own model classes on the CPU (``sglang_oracle/model_load.py``: its llama and qwen2
``load_weights``, TP=1 and TP=2, bf16 engine from fp32 trainer tensors, stacked projections, a padded
and a tied vocabulary), and the loads that must not be replayed."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from sglang_protocol import held_weights
from sglang_protocol.net import free_port
from _fixtures_sglang import ROOT


def _config(kind: str, path, tied: bool) -> None:
    from transformers import LlamaConfig, Qwen2Config

    cls = LlamaConfig if kind == "llama" else Qwen2Config
    arch = "LlamaForCausalLM" if kind == "llama" else "Qwen2ForCausalLM"
    cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=95, architectures=[arch], tie_word_embeddings=tied).save_pretrained(path)


def test_held_pushes_into_sglang_models_replay_exactly_what_load_weights_writes(tmp_path):
    """Three pushes of the same storages into SGLang's own llama (TP=1, untied, vocabulary padded
    95 -> 128 rows) and qwen2 (TP=2, tied, q/k/v biases): the first walks ``load_weights`` (recorded),
    the next two replay it, and after each the engine's every parameter equals a second SGLang model
    loaded by ``load_weights`` with the same tensors; every parameter changed between pushes."""
    runs = {"llama": (1, False), "qwen2": (2, True)}
    procs = []
    for kind, (tp, tied) in runs.items():
        (tmp_path / kind / "out").mkdir(parents=True)
        _config(kind, tmp_path / kind, tied)
        port = free_port()
        for rank in range(tp):
            cmd = [sys.executable, str(ROOT / "tests/sglang_oracle/model_load.py"), "--arch", kind, "--tp", str(tp),
                   "--rank", str(rank), "--port", str(port), "--model-dir", str(tmp_path / kind),
                   "--out", str(tmp_path / kind / "out")]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-3000:]
    for kind, (tp, _) in runs.items():
        for rank in range(tp):
            r = json.loads((tmp_path / kind / "out" / f"rank{rank}.json").read_text())
            assert [p["replays"] for p in r["pushes"]] == [0, 1, 2], (kind, rank)
            assert all(p["differ"] == [] for p in r["pushes"]), (kind, rank, r["pushes"])
            assert [p["changed"] for p in r["pushes"][1:]] == [r["num_params"]] * 2
            assert r["num_copies"] >= r["num_params"] and r["steps"] < r["num_copies"]  # batched
        if kind == "llama":
            assert r["shapes"]["model.embed_tokens.weight"] == [128, 64]  # padded: its fill_ replayed too
        else:
            assert r["shapes"]["model.layers.0.self_attn.qkv_proj.weight"] == [64, 64]  # (4+2+2)*8 / 2 ranks


class _Model(torch.nn.Module):
    """Two parameters and a ``load_weights`` given by each test."""

    def __init__(self, load):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(6, dtype=torch.bfloat16), requires_grad=False)
        self._load = load

    def load_weights(self, named):
        with torch.no_grad():
            self._load(self, dict(named))


def _trainer():
    flat = torch.randn(12 + 6)
    return flat, [("a", flat[:12].view(4, 3)), ("b", flat[12:])]


def _push(model, named):
    held_weights.load_and_hold(model, held_weights.pack(named))


def _plain(m, w):
    m.a.copy_(w["a"])
    m.b[:3].copy_(w["b"][3:])  # a shard, stacked in reverse
    m.b[3:].copy_(w["b"][:3])


def _expect_plain(flat):
    return flat[:12].view(4, 3).bfloat16(), torch.cat([flat[15:], flat[12:15]]).bfloat16()


@pytest.mark.parametrize("load, replayed", [
    (_plain, True),
    (lambda m, w: (m.a.fill_(7), m.a[1:].copy_(w["a"][1:]), _plain_b(m, w)), True),  # a fill, then copies over it
    (lambda m, w: (m.a.copy_(w["a"] * 2), _plain_b(m, w)), False),  # from a temporary: not a copy of received bytes
    (lambda m, w: (setattr(m, "t", w["a"].sum(0)), _plain(m, w)), False),  # a derived tensor kept on the model
])
def test_a_held_load_is_replayed_only_when_it_is_copies_of_received_bytes(load, replayed, caplog):
    flat, named = _trainer()
    model = _Model(load)
    ref = _Model(load)
    with caplog.at_level(logging.WARNING, logger="sglang_protocol.held_weights"):
        for step in range(3):
            if step:
                flat.add_(1.0)
            _push(model, named)
            ref.load_weights([(n, t.clone()) for n, t in named])
            assert torch.equal(model.a, ref.a) and torch.equal(model.b, ref.b), step
    assert held_weights.replays(model) == (2 if replayed else 0)
    assert ("none is replayed" in caplog.text) == (not replayed)
    held_weights.load_and_hold(model, [])
    assert held_weights.replays(model) == 0


def _plain_b(m, w):
    m.b[:3].copy_(w["b"][3:])
    m.b[3:].copy_(w["b"][:3])


def test_overlapping_writes_replay_in_their_order_and_a_new_storage_is_recorded_again():
    def load(m, w):  # the second copy overwrites part of the first: order matters
        m.b.copy_(w["b"])
        m.b[:2].copy_(w["a"][0, :2])
        m.a.copy_(w["a"])

    flat, named = _trainer()
    model = _Model(load)
    for _ in range(2):
        _push(model, named)
        flat.add_(1.0)
    _push(model, named)
    assert held_weights.replays(model) == 2
    want_b = flat[12:].bfloat16().clone()
    want_b[:2] = flat[:2].bfloat16()
    assert torch.equal(model.b, want_b) and torch.equal(model.a, flat[:12].view(4, 3).bfloat16())
    flat2, named2 = _trainer()  # the trainer's buffer reallocated: other storages, recorded afresh
    _push(model, named2)
    assert held_weights.replays(model) == 0
    _push(model, named2)
    assert held_weights.replays(model) == 1
    want_b = flat2[12:].bfloat16().clone()
    want_b[:2] = flat2[:2].bfloat16()
    assert torch.equal(model.b, want_b)
    held_weights.load_and_hold(model, [])


def test_plain_model_load_matches_expected_values():
    flat, named = _trainer()
    model = _Model(_plain)
    _push(model, named)
    flat.mul_(-1)
    _push(model, named)
    a, b = _expect_plain(flat)
    assert held_weights.replays(model) == 1 and torch.equal(model.a, a) and torch.equal(model.b, b)
    held_weights.load_and_hold(model, [])
