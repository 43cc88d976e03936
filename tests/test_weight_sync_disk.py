"""The disk fallback writes a checkpoint that transformers loads, with the pushed values, in the
dtype the engines serve."""

from __future__ import annotations

import json

import pytest
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


def test_each_tensor_is_written_in_the_dtype_given(tmp_path):
    from safetensors.torch import load_file

    w, ids = torch.randn(4, 3), torch.arange(5)
    path = write_hf_checkpoint([("w", w), ("ids", ids)], tmp_path, version=1, dtypes=["bfloat16", "int64"])
    got = load_file(path / "model.safetensors")
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], w.to(torch.bfloat16))
    assert torch.equal(got["ids"], ids) and w.dtype == torch.float32  # the trainer's tensor is left as it was
    with pytest.raises(ValueError, match="1 dtypes for 2 tensors"):
        write_hf_checkpoint([("w", w), ("ids", ids)], tmp_path, version=2, dtypes=["bfloat16"])


def test_a_bf16_engine_gets_a_bf16_checkpoint(ws_toy_model, tmp_path):  # noqa: F811
    """The disk transport writes what the engines serve (as the tensor and distributed transports
    send it): a float32 trainer's push to a bfloat16 engine is a bfloat16 checkpoint, half the bytes,
    and the engine then holds exactly the trainer's weights cast to bfloat16 (checked by reading
    them back, --check-weight-update-equal)."""
    from safetensors import safe_open

    from tests._fixtures_weight_sync import perturbed_model, start_engines, stop_engines
    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    es = start_engines(ws_toy_model, 1, weight_update_dirs=str(tmp_path), dtype="bfloat16")
    try:
        s = WeightSyncSettings(transport="disk", disk_dir=str(tmp_path / "w"), hf_checkpoint=str(ws_toy_model),
                               check_equal=True, timeout_s=60)
        new = perturbed_model(ws_toy_model, 0.9)
        with WeightSender(s) as sender:
            sender.connect([es[0][1]])
            m = sender.push(new.named_parameters(), version=4)
        assert m["weight_sync/check_s"] > 0 and _served(es[0][1]) == "4"
        with safe_open(str(checkpoint_dir(tmp_path / "w", 4) / "model.safetensors"), "pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert dtypes == {"BF16"}, dtypes
    finally:
        stop_engines(es)


# --- slime's --custom-update-weight-post-write-path, through the disk transport to a real engine ---------------

def _ws_args(*argv: str):
    import argparse

    from weight_sync.arguments import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--hf-checkpoint")
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def one_engine(ws_toy_model, tmp_path_factory):  # noqa: F811
    from tests._fixtures_weight_sync import start_engines, stop_engines

    disk = tmp_path_factory.mktemp("post_write")
    es = start_engines(ws_toy_model, 1, weight_update_dirs=str(disk))
    yield es[0][1], disk
    stop_engines(es)


def _served(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/model_info", timeout=30) as resp:
        return json.loads(resp.read())["weight_version"]


def test_post_write_hook_runs_between_write_and_load(one_engine, ws_toy_model, tmp_path):  # noqa: F811
    from tests._fixtures_weight_sync import perturbed_model
    from weight_sync.arguments import load_post_write_hook, settings_from_args
    from weight_sync.sender import WeightSender

    url, disk = one_engine
    log = tmp_path / "hook.jsonl"
    args = _ws_args("--update-weight-transport", "disk", "--update-weight-disk-dir", str(disk / "w"),
                    "--hf-checkpoint", str(ws_toy_model), "--update-weight-timeout", "60",
                    "--custom-update-weight-post-write-path", "slime_fixtures.weight_hooks.publish")
    args.hook_log, args.hook_tag = str(log), "from-args"  # what the plugin reads from slime's args
    before = _served(url)
    with WeightSender(settings_from_args(args), post_write=load_post_write_hook(args)) as sender:
        sender.connect([url])
        sender.push(perturbed_model(ws_toy_model, 0.9).named_parameters(), version=5)
        assert _served(url) == "5"
        (event,) = [json.loads(line) for line in open(log)]
        # called once the directory was complete under its final name, before the engine loaded it
        assert event["version_dir"] == str(checkpoint_dir(disk / "w", 5)) and event["engines"] == [url]
        assert event["served"] == [before] and event["tag"] == "from-args"
        assert {"config.json", "model.safetensors"} <= set(event["files"])
        assert (checkpoint_dir(disk / "w", 5) / "PUBLISHED").exists()
        # a hook that fails (an upload refused) fails the push, naming the flag; the engine keeps v5
        args.fail_publish = True
        with pytest.raises(RuntimeError, match="--custom-update-weight-post-write-path failed on .*weights_v6.*"
                                               "OSError: upload of .* refused"):
            sender.push(perturbed_model(ws_toy_model, 0.8).named_parameters(), version=6)
        assert _served(url) == "5"


def test_post_write_hook_is_refused_where_it_cannot_run(ws_toy_model):  # noqa: F811
    from weight_sync.arguments import settings_from_args

    with pytest.raises(ValueError, match="--custom-update-weight-post-write-path x.y: slime calls it after a disk "
                                         "weight update's files are written; with --update-weight-transport "
                                         "distributed nothing is written"):
        settings_from_args(_ws_args("--update-weight-transport", "distributed",
                                    "--custom-update-weight-post-write-path", "x.y"))
    with pytest.raises(ValueError, match="--custom-update-weight-post-write-path 'slime_fixtures.weight_hooks.nope': "
                                         "module 'slime_fixtures.weight_hooks' has no attribute 'nope'"):
        settings_from_args(_ws_args("--update-weight-transport", "disk", "--hf-checkpoint", str(ws_toy_model),
                                    "--custom-update-weight-post-write-path", "slime_fixtures.weight_hooks.nope"))


def test_trainer_rank_binds_the_post_write_hook_from_the_launchers_args(one_engine, ws_toy_model, tmp_path):  # noqa: F811
    """The launcher path: trainer rank 0 builds its sender with the hook, bound to the args trainer
    plugins see (``TrainSettings.plugin_args``, the launcher's namespace)."""
    from tests._fixtures_weight_sync import perturbed_model
    from train_backend.actor_group import TrainerRank
    from train_backend.interfaces import TrainSettings
    from weight_sync.arguments import settings_from_args

    url, disk = one_engine
    log = tmp_path / "hook.jsonl"
    args = _ws_args("--update-weight-transport", "disk", "--update-weight-disk-dir", str(disk / "r"),
                    "--hf-checkpoint", str(ws_toy_model), "--update-weight-timeout", "60",
                    "--custom-update-weight-post-write-path", "slime_fixtures.weight_hooks.publish")
    rank = TrainerRank(0, 1)
    rank.train = TrainSettings(hf_checkpoint=str(ws_toy_model),
                               plugin_args={**vars(args), "hook_log": str(log), "hook_tag": "from-launcher"})
    rank.connect_weight_sync(settings_from_args(args), [url], [1], None)
    try:
        rank.sender.push(perturbed_model(ws_toy_model, 0.7).named_parameters(), version=9)
    finally:
        rank.sender.close()
    (event,) = [json.loads(line) for line in open(log)]
    assert event["tag"] == "from-launcher" and event["version_dir"] == str(checkpoint_dir(disk / "r", 9))
    assert _served(url) == "9"
