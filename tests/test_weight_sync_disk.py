"""The disk fallback writes a checkpoint that transformers loads, with the pushed values."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests._fixtures_weight_sync import ws_toy_model  # noqa: F401  (fixture)
from weight_sync.disk import checkpoint_dir, prune_checkpoints, write_hf_checkpoint


def test_written_checkpoint_loads_with_new_weights(ws_toy_model, tmp_path):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(ws_toy_model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # a "trained" version, different from the template's weights
    named = list(model.named_parameters())
    # A tiny shard size forces several shards and an index file.
    path = write_hf_checkpoint(named, tmp_path / "ckpt", version=3, hf_checkpoint=ws_toy_model,
                               max_shard_size=20_000)
    assert path == checkpoint_dir(tmp_path / "ckpt", 3) and path.is_dir()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {n for n, _ in named}
    assert len(set(index["weight_map"].values())) > 1
    loaded = AutoModelForCausalLM.from_pretrained(path)
    for (n, a), (m, b) in zip(model.named_parameters(), loaded.named_parameters()):
        assert n == m and torch.equal(a, b), n
    assert AutoTokenizer.from_pretrained(path).get_vocab() == AutoTokenizer.from_pretrained(ws_toy_model).get_vocab()


def test_retry_replaces_and_old_versions_are_pruned(tmp_path):
    named = [("w", torch.arange(6.0).reshape(2, 3))]
    for v in (1, 2, 3, 3):  # v3 twice: a retried push replaces it whole
        write_hf_checkpoint(named, tmp_path, version=v, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights_v2", "weights_v3"]
    assert prune_checkpoints(tmp_path, keep=1) == [tmp_path / "weights_v2"]
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "weights_v3" / "model.safetensors")["w"], named[0][1])
