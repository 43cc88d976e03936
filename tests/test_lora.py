"""LoRA RL (issue 28): the toy task learns through the launcher with only the adapter trained and
pushed; the engines serve exactly the trainer's adapter; bad LoRA flags and the Megatron backend
are refused with one-line errors naming the flag."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest

from _fixtures_engine import engine_model, reference_logprobs  # noqa: F401
from _fixtures_launcher import launcher_cmd, run_until_it_kills_itself
from flags import from_args

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/toy/grpo_lora_cpu.yaml"


def lora_cmd(model: Path, out: Path, *extra: str) -> list[str]:
    return launcher_cmd(CONFIG, model, out, *extra)


def test_toy_task_learns_with_lora_and_adapter_only_pushes(warm_toy, tmp_path):
    """40 steps of examples/toy/grpo_lora_cpu.yaml: eval rises (measured at step 40 with --seed 1
    and 2: 0.344 -> 0.547 and 0.531; the bound, +0.06, is a third of the smallest rise); every push carried only the adapter, verified on both engines by
    read-back; every sample is tagged with the version it ran on; and the engines' log-probs of the
    sampled tokens equal the trainer's (base + the same adapter) at every step."""
    n = 40
    out = tmp_path / "lora"
    proc = subprocess.run(lora_cmd(warm_toy, out, "--num-rollout", str(n), "--eval-interval", str(n),
                                   "--check-weight-update-equal", "--save", str(tmp_path / "ckpt"),
                                   "--save-interval", str(n)),
                          cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(n))
    model_bytes = sum(f.stat().st_size for f in warm_toy.glob("*.safetensors"))
    for r in steps:
        assert r["weight_sync/adapter"] == 1.0 and r["weight_sync/engines"] == 2
        # the adapter, not the model (rank 16 of the toy's hidden size 64: a third of its bytes)
        assert 0 < r["weight_sync/bytes"] < model_bytes / 2
        assert r["weight_sync/check_s"] > 0  # both engines' adapters read back and compared
        assert r["rollout/weight_version_min"] == r["rollout/weight_version_max"] == r["step"]
        # served = trained: an engine serving the base, or a stale adapter, differs by ~1e-2 here
        assert r["train/train_rollout_logp_abs_diff"] < 1e-4, r
    assert [r["weight_sync/version"] for r in steps] == [float(s + 1) for s in range(n)]
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    assert len(evals) == 2 and evals[1] >= evals[0] + 0.06, evals
    # the checkpoint holds the adapter in peft's format (and no copy of the base)
    adapters = list((tmp_path / "ckpt").rglob("adapter_model.safetensors"))
    assert adapters and all((a.parent / "adapter_config.json").is_file() for a in adapters)
    assert not list((tmp_path / "ckpt").rglob("model.safetensors"))


@pytest.mark.slow  # CI time (two launcher runs); tests/test_e2e_train.py's resume test covers full weights in CI
def test_sigkill_and_resume_with_lora_trains_every_group_once_on_the_restored_adapter(warm_toy, tmp_path):
    """Killed in step 5 (checkpoint of step 3), resumed with --load: every group of every step
    trained once, on-policy, and from the resumed step on the engines serve the restored adapter
    (their log-probs equal the trainer's, which loaded the adapter and its optimizer state)."""
    from buffer.arrow import read_parquet

    out, ckpt = tmp_path / "resume", tmp_path / "ckpt"
    n_steps, batch = 8, 16
    extra = ["--num-rollout", str(n_steps), "--save", str(ckpt), "--save-interval", "2",
             "--save-debug-rollout-data", str(out / "dump_{rollout_id}.parquet"), "--rollout-batch-size", str(batch)]
    run_until_it_kills_itself(lora_cmd(warm_toy, out, *extra), tmp_path / "first.log", "after_get:5")
    assert json.loads((ckpt / "latest.json").read_text())["step"] == 3
    assert list(ckpt.rglob("adapter_model.safetensors"))
    proc = subprocess.run(lora_cmd(warm_toy, out, *extra, "--load", str(ckpt)), cwd=ROOT,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(n_steps))
    assert all(r["train/train_rollout_logp_abs_diff"] < 1e-4 for r in steps), steps
    batches = [read_parquet(out / f"dump_{step}.parquet") for step in range(n_steps)]
    assert sorted(g[0].group_index for groups in batches for g in groups) == list(range(n_steps * batch))
    assert all(min(s.weight_versions) == step for step, groups in enumerate(batches) for g in groups for s in g)


def _lora_args(**kw) -> argparse.Namespace:
    base = {"lora_rank": 8, "lora_alpha": 16.0, "lora_dropout": 0.0, "target_modules": "all-linear"}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("bad, flag", [({"lora_rank": -1}, "--lora-rank"), ({"lora_alpha": 0.0}, "--lora-alpha"),
                                       ({"lora_dropout": 1.0}, "--lora-dropout"),
                                       ({"lora_dropout": -0.1}, "--lora-dropout"),
                                       ({"target_modules": " , "}, "--target-modules")])
def test_bad_lora_flags_are_one_line_errors_naming_the_flag(bad, flag):
    from train_backend.lora import LoraSettings

    with pytest.raises(ValueError) as e:
        from_args(LoraSettings, _lora_args(**bad))
    assert str(e.value).startswith(flag) and "\n" not in str(e.value), str(e.value)


def test_a_target_module_the_model_lacks_is_refused_naming_the_flag(toy_model_dir):
    from transformers import AutoModelForCausalLM

    from train_backend.lora import LoraSettings, wrap

    model = AutoModelForCausalLM.from_pretrained(toy_model_dir)
    with pytest.raises(ValueError, match=r"^--target-modules: 'qkv_proj' matches no module of the model") as e:
        wrap(model, from_args(LoraSettings, _lora_args(target_modules="q_proj,qkv_proj")))
    assert "\n" not in str(e.value)
    peft_model = wrap(model, from_args(LoraSettings, _lora_args(target_modules="q_proj,v_proj")))
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and ("q_proj" in n or "v_proj" in n) for n in trainable)


@pytest.mark.parametrize("extra, words", [
    (("--train-backend", "megatron"), ("--lora-rank 16", "--train-backend megatron")),
    (("--check-weight-update-equal", "--rollout-engine", "sglang", "--rollout-num-gpus", "1"),
     ("--check-weight-update-equal with --lora-rank", "--rollout-engine sglang")),
    (("--lora-dropout", "1.5"), ("--lora-dropout=1.5 must be in [0, 1)",)),
    (("--actor-num-gpus-per-node", "2"), ("--lora-rank 16 with 2 trainer ranks", "LoRA trains on one rank"))])
def test_launcher_refuses_lora_it_cannot_run_at_start_up(toy_model_dir, tmp_path, extra, words):
    """The launcher stops before starting anything, with one line naming the flags: Megatron has no
    LoRA; real SGLang cannot read an adapter back for --check-weight-update-equal; a bad value;
    several trainer ranks (the adapter is not gathered from FSDP2 shards)."""
    proc = subprocess.run(lora_cmd(toy_model_dir, tmp_path / "refused", *extra), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("scripts/train.py: error: ") and all(w in last for w in words), proc.stderr[-2000:]


# --- the engine side: SGLang's LoRA routes on the embedded engine, and the adapter push ----------------------------

def _trained_adapter(model_dir: Path, seed: int = 0):
    """A peft model of the toy model with a random (non-zero) rank-4 adapter on q_proj and v_proj."""
    import torch
    from transformers import AutoModelForCausalLM

    from train_backend.lora import LoraSettings, wrap

    model = wrap(AutoModelForCausalLM.from_pretrained(model_dir),
                 from_args(LoraSettings, _lora_args(lora_rank=4, lora_alpha=8.0, target_modules="q_proj,v_proj")))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


@pytest.mark.parametrize("transport", ["auto", "tensor"])  # auto: the adapter goes from disk
def test_engine_serves_base_plus_the_pushed_adapter_and_reads_it_back(engine_model, tmp_path,  # noqa: F811 (fixture)
                                                                       transport):
    """WeightSender.push_adapter to an embedded engine with --enable-lora (from disk, or from tensors as
    colocated pushes load it): the adapter read back
    equals the trainer's (--check-weight-update-equal), a request naming it samples from base +
    adapter (its log-probs equal peft's), a request without lora_path from the base alone, and
    SGLang's errors (a second load of a loaded name, an unknown lora_path) are 400s; the same adapter
    loaded through /load_lora_adapter_from_tensors serves the same tokens."""
    from _fixtures_engine import run, start_engine, stop_process
    from sglang_protocol.client import EngineClient, EngineError
    from sglang_protocol.lora_adapter import POLICY_ADAPTER
    from train_backend.lora import adapter_config, adapter_tensors
    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    peft_model = _trained_adapter(engine_model)
    proc, url = start_engine(engine_model, enable_lora=True, max_lora_rank=8, weight_update_dirs=str(tmp_path))
    try:
        versions: list[int] = []
        with WeightSender(WeightSyncSettings(transport=transport, check_equal=True, disk_dir=str(tmp_path / "adapters")),
                          version_sink=versions.append) as sender:
            sender.connect([url])
            m = sender.push_adapter(adapter_config(peft_model, str(engine_model)), adapter_tensors(peft_model), 3)
        assert versions == [3] and m["weight_sync/check_s"] > 0 and m["weight_sync/adapter"] == 1.0

        async def scenario() -> None:
            async with EngineClient(url) as c:
                prompt = [1, 5, 6, 7, 8]
                greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
                tuned = await c.generate(input_ids=prompt, sampling_params=greedy, lora_path=POLICY_ADAPTER)
                base = await c.generate(input_ids=prompt, sampling_params=greedy)
                assert tuned["meta_info"]["weight_version"] == "3"
                for r, want in ((tuned, peft_model), (base, None)):
                    out = r["output_ids"]
                    got = [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]
                    if want is None:
                        with peft_model.disable_adapter():
                            ref = reference_logprobs(peft_model, prompt, out, 1.0)
                    else:
                        ref = reference_logprobs(want, prompt, out, 1.0)
                    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4, (got, ref)
                with peft_model.disable_adapter():  # the adapter changes the model: the check above can fail
                    base_ref = reference_logprobs(peft_model, prompt, tuned["output_ids"], 1.0)
                tuned_lps = [lp for lp, _, _ in tuned["meta_info"]["output_token_logprobs"]]
                assert max(abs(a - b) for a, b in zip(tuned_lps, base_ref)) > 1e-2
                # SGLang's /load_lora_adapter_from_tensors (the colocated route): the same adapter, another name
                from sglang_protocol.buckets import tensor_checksum
                from sglang_protocol.tensor_update import serialize

                tensors = adapter_tensors(peft_model)
                await c.request("POST", "/load_lora_adapter_from_tensors", {
                    "lora_name": "from_tensors", "config_dict": adapter_config(peft_model),
                    "serialized_named_tensors": [serialize(tensors)]})
                again = await c.generate(input_ids=prompt, sampling_params=greedy, lora_path="from_tensors")
                assert again["output_ids"] == tuned["output_ids"]
                assert [x[0] for x in again["meta_info"]["output_token_logprobs"]] == tuned_lps
                bad = {**{k: tensor_checksum(v) for k, v in tensors.items()}, next(iter(tensors)): "0" * 64}
                with pytest.raises(EngineError, match="expected_checksums: 1 adapter tensor"):
                    await c.request("POST", "/load_lora_adapter_from_tensors", {
                        "lora_name": "corrupt", "config_dict": adapter_config(peft_model),
                        "serialized_named_tensors": [serialize(tensors)], "expected_checksums": bad})
                ckpt = str(tmp_path / "adapters" / "v3")
                with pytest.raises(EngineError, match="already loaded"):
                    await c.request("POST", "/load_lora_adapter", {"lora_name": POLICY_ADAPTER, "lora_path": ckpt})
                with pytest.raises(EngineError, match="lora_path: the LoRA adapter 'nope' is not loaded"):
                    await c.generate(input_ids=prompt, sampling_params=greedy, lora_path="nope")
                await c.request("POST", "/unload_lora_adapter", {"lora_name": POLICY_ADAPTER})
                with pytest.raises(EngineError, match="not loaded"):
                    await c.generate(input_ids=prompt, sampling_params=greedy, lora_path=POLICY_ADAPTER)
        run(scenario())
    finally:
        stop_process(proc)


def test_checkpoint_holds_the_adapter_and_its_optimizer_only_and_load_restores_them(toy_model_dir, tmp_path):
    """save() writes the adapter and its AdamW state (not the base) and the adapter in peft's format;
    load() into a fresh backend restores both exactly."""
    import torch

    from sglang_protocol.lora_adapter import read_adapter
    from train_backend.lora import LoraSettings
    from train_backend.settings import TrainSettings
    from train_backend.torch_backend import TorchBackend

    def backend() -> TorchBackend:
        return TorchBackend(TrainSettings(hf_checkpoint=str(toy_model_dir), lr=1e-2,
                                          lora=from_args(LoraSettings, _lora_args(lora_rank=4))))

    a = backend()
    assert all(("lora_" in n) == p.requires_grad for n, p in a.model.named_parameters())
    assert {id(p) for g in a.optimizer.param_groups for p in g["params"]} == \
        {id(p) for p in a.model.parameters() if p.requires_grad}
    for _ in range(2):  # moves the adapter (B starts at 0) and fills Adam's moments
        for p in a.model.parameters():
            if p.requires_grad:
                p.grad = torch.randn_like(p)
        a.optimizer_step()
    a.save(str(tmp_path / "ckpt"))
    base_bytes = sum(f.stat().st_size for f in toy_model_dir.glob("*.safetensors"))
    saved = sum(f.stat().st_size for f in (tmp_path / "ckpt" / "dcp").rglob("*") if f.is_file())
    assert saved < base_bytes  # adapter + 2 Adam moments of it; the full model alone would be base_bytes
    config, peft_tensors = read_adapter(str(tmp_path / "ckpt" / "adapter"))
    assert config["r"] == 4 and set(peft_tensors) == set(a.adapter()[1])

    b = backend()
    assert any(not torch.equal(b.adapter()[1][k], v) for k, v in a.adapter()[1].items())  # fresh: differs
    b.load(str(tmp_path / "ckpt"))
    for k, v in a.adapter()[1].items():
        assert torch.equal(b.adapter()[1][k], v), k
        assert torch.equal(peft_tensors[k], v), k
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)
    assert b.optimizer_steps == 2


def test_an_engine_without_enable_lora_refuses_lora_path_and_adapters():
    """SGLang serves lora_path only with --enable-lora; the embedded engine answers 400 naming it."""
    from embedded_engine.lora import LoraAdapters, LoraError
    from embedded_engine.settings import parse_settings

    off = LoraAdapters({}, None, enabled=False, max_rank=None, target_modules=None)
    assert off.resolve(None) is None
    with pytest.raises(LoraError, match=r"^lora_path: LoRA is not enabled on this engine \(start it with --enable-lora\)"):
        off.resolve("policy")
    s = parse_settings(["--model-path", "/m", "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules",
                        "q_proj", "v_proj"])
    assert (s.enable_lora, s.max_lora_rank, s.lora_modules()) == (True, 8, ["q_proj", "v_proj"])
    assert "--enable-lora" in s.to_cli() and parse_settings(s.to_cli()).lora_modules() == ["q_proj", "v_proj"]


def test_slime_generate_payloads_to_our_engines_name_the_adapter(monkeypatch):
    """slime's generate functions build their own /generate payloads (post()): with --lora-rank the
    ones to our router or engines get lora_path, unless they name an adapter; other calls are untouched."""
    from types import SimpleNamespace

    from slime_compat.utils import http_utils

    ctx = SimpleNamespace(settings=SimpleNamespace(sampling=SimpleNamespace(lora_path="policy")))
    monkeypatch.setattr(http_utils, "current_context", lambda default=None: ctx)
    body = {"input_ids": [1, 2], "sampling_params": {}}
    assert http_utils._with_adapter("http://r:1/generate", body, True) == {**body, "lora_path": "policy"}
    assert http_utils._with_adapter("http://r:1/generate", {**body, "lora_path": "x"}, True)["lora_path"] == "x"
    assert http_utils._with_adapter("http://teacher:2/generate", body, False) is body  # not our engines
    assert http_utils._with_adapter("http://r:1/abort_request", body, True) is body
    ctx.settings.sampling.lora_path = None
    assert http_utils._with_adapter("http://r:1/generate", body, True) is body


# --- the GPU tier: real SGLang (marker sglang; tests/test_sglang_gpu.py's fixtures) -----------------------------------

def _merged_reference(model_dir: Path, config: dict, tensors: dict) -> "torch.nn.Module":
    """The toy model with the adapter merged into its weights, by hand (``scaling * B @ A``; no peft)."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_protocol.lora_adapter import merged_deltas

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, delta in merged_deltas(config, tensors).items():
            params[name].add_(delta)
    return model


@pytest.mark.sglang
@pytest.mark.timeout(900)
def test_sglang_serves_the_adapter_a_push_loads_from_disk(toy_model_dir, tmp_path):
    """Real SGLang with --enable-lora: WeightSender.push_adapter (peft files, /unload_lora_adapter
    tolerated on the first push, /load_lora_adapter, /update_weight_version) twice; a request naming
    the adapter samples from base + adapter (log-probs near the merged model's, bf16), one without
    from the base, and each reports the pushed version. Written 2026-12-05 and not run yet (no device
    time was left in that session): the GPU tier's first run of it checks the disk route against SGLang."""
    import torch

    from _fixtures_sglang import sglang_available, sglang_version, start_sglang, stop_sglang
    from sglang_protocol.lora_adapter import POLICY_ADAPTER, peft_config
    from sglang_protocol.net import free_port
    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    if not sglang_available():
        pytest.skip("needs a CUDA GPU and SGLang (the GPU machine)")
    print("sglang", sglang_version())
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, p in base.named_parameters():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in ("q_proj", "v_proj"):
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(8, p.shape[1], generator=g) * 0.3
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(p.shape[0], 8, generator=g) * 0.3
    config = peft_config(8, 16.0, ["q_proj", "v_proj"], str(toy_model_dir))
    tuned_ref = _merged_reference(toy_model_dir, config, tensors)
    port = free_port()
    proc = start_sglang(toy_model_dir, port, "--dtype", "bfloat16", "--mem-fraction-static", "0.2",
                        "--disable-cuda-graph", "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules",
                        "q_proj", "v_proj", log=tmp_path / "sglang.log")
    url = f"http://127.0.0.1:{port}"
    try:
        s = WeightSyncSettings(transport="disk", disk_dir=str(tmp_path / "adapters"), hf_checkpoint=str(toy_model_dir))
        with WeightSender(s) as sender:
            sender.connect([url])
            sender.push_adapter(config, tensors, 1)
            m = sender.push_adapter(config, tensors, 2)  # a second push: unload, then load again
        assert m["weight_sync/adapter"] == 1.0

        from _fixtures_engine import run
        from sglang_protocol.client import EngineClient

        async def generate(lora_path):
            async with EngineClient(url) as c:
                return await c.generate(input_ids=[1, 5, 6, 7, 8], lora_path=lora_path,
                                        sampling_params={"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True})
        for lora_path, ref in ((POLICY_ADAPTER, tuned_ref), (None, base)):
            out = run(generate(lora_path))
            assert out["meta_info"]["weight_version"] == "2"
            got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
            want = reference_logprobs(ref, [1, 5, 6, 7, 8], out["output_ids"], 1.0)
            other = reference_logprobs(base if ref is tuned_ref else tuned_ref, [1, 5, 6, 7, 8], out["output_ids"],
                                       1.0)
            err = max(abs(a - b) for a, b in zip(got, want))
            print(lora_path, "max |sglang - reference|", err, "vs the other model", max(abs(a - b) for a, b in zip(got, other)))
            assert err < 0.1, (lora_path, got, want)
        prompt, served = [1, 5, 6, 7, 8], out["output_ids"]
        assert max(abs(a - b) for a, b in zip(reference_logprobs(base, prompt, served, 1.0),
                                              reference_logprobs(tuned_ref, prompt, served, 1.0))) > 0.3
    finally:
        stop_sglang(proc)
        print((tmp_path / "sglang.log").read_text()[-3000:])


def test_an_adapter_push_goes_on_without_a_dead_engine_and_a_restarted_one_gets_it(engine_model, tmp_path):  # noqa: F811
    """Two engines, one killed: the push's first attempt fails on it, the second loads the adapter on
    the other; the engine started again on the same port gets the adapter at the next push."""
    from _fixtures_engine import run, start_engine, stop_process
    from sglang_protocol.client import EngineClient
    from sglang_protocol.lora_adapter import POLICY_ADAPTER
    from train_backend.lora import adapter_config, adapter_tensors
    from weight_sync.interfaces import WeightSyncSettings
    from weight_sync.sender import WeightSender

    peft_model = _trained_adapter(engine_model)
    config, tensors = adapter_config(peft_model), adapter_tensors(peft_model)
    kw = dict(enable_lora=True, weight_update_dirs=str(tmp_path))
    (a, url_a), (b, url_b) = start_engine(engine_model, **kw), start_engine(engine_model, **kw)
    try:
        with WeightSender(WeightSyncSettings(check_equal=True, disk_dir=str(tmp_path / "adapters"), timeout_s=10,
                                             retries=1)) as sender:
            sender.connect([url_a, url_b])
            sender.push_adapter(config, tensors, 1)
            stop_process(b)
            m = sender.push_adapter(config, tensors, 2)
            assert m["weight_sync/attempts"] == 2 and m["weight_sync/engines"] == 1
            assert not sender.engine_status()[url_b]["alive"]
            from embedded_engine import EngineSettings, launch_engine_process

            b, _ = launch_engine_process(EngineSettings(model_path=str(engine_model), port=int(url_b.rsplit(":", 1)[1]),
                                                        num_threads=1, **kw), timeout_s=180)
            m = sender.push_adapter(config, tensors, 3)
            assert m["weight_sync/engines"] == 2 and m["weight_sync/attempts"] == 1

        async def version_of(url: str) -> str:
            async with EngineClient(url) as c:
                out = await c.generate(input_ids=[1, 5, 6], lora_path=POLICY_ADAPTER,
                                       sampling_params={"max_new_tokens": 1, "temperature": 0.0})
                return out["meta_info"]["weight_version"]
        assert run(version_of(url_a)) == run(version_of(url_b)) == "3"
    finally:
        stop_process(a)
        stop_process(b)
