"""Embedded engine, native forward (embedded_engine/native_forward.py): for tiny random
llama-family models (GQA, q/k/v bias, tied and untied embeddings, RoPE scaling, Qwen3's q/k
norms, Mistral) the runner takes the native path, and its prefill logits and decode log-probs
equal transformers' full forward to 1e-5 in fp32 through padding, mixed lengths, a join and a
leave; an unsupported model takes transformers' path; every weight-write path reaches the
native forward's fused and packed weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from _fixtures_engine import engine_model, greedy_taker, hf_model, reference_logprobs, write_weights  # noqa: F401  (fixtures)
from embedded_engine.model_runner import ModelRunner, PackedLinears
from embedded_engine.settings import EngineSettings

SMALL = dict(vocab_size=95, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (config class, extra config fields)
CONFIGS = {
    "llama_gqa_untied": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama_tied_mha_linear_rope": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=4,
                                                       rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                        "rope_theta": 10000.0})),
    "llama_yarn_bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True,
                                            rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 500.0,
                                                             "original_max_position_embeddings": 32})),
    "qwen2_bias_tied": ("Qwen2Config", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen3_qk_norm_head_dim": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False)),
}


def _save(model, out: Path, tokenizer_from: Path) -> Path:
    model.save_pretrained(out)
    for f in tokenizer_from.iterdir():  # the toy tokenizer (vocab 95)
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return out


def _build(name: str, root: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    import transformers

    cls_name, extra = CONFIGS[name]
    cfg = getattr(transformers, cls_name)(**{**SMALL, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # random biases and norm weights (zero/one at init would hide a missing term)
        for n, p in model.named_parameters():
            if "bias" in n or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return _save(model, root / f"{name}_s{seed}", tokenizer_from)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread here (restored after): tiny forwards on a shared 2-core box run 10-30x
    slower when two threads spin against other processes."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tmp_path_factory, engine_model) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("native_models")
    return {name: _build(name, root, engine_model) for name in CONFIGS}


def _runner(path: Path, **kw) -> ModelRunner:
    return ModelRunner(EngineSettings(model_path=str(path), **kw))


def _prompts(g: torch.Generator, lens) -> list[list[int]]:
    return [torch.randint(7, 95, (n,), generator=g).tolist() for n in lens]


def _alone_last_logits(model, prompts) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([p])).logits[:, -1] for p in prompts])  # [n, V]


def _run_scenario(runner: ModelRunner, model) -> None:
    """Mixed-length prefill, decode steps, a join, a leave: every log-prob == full forward."""
    g = torch.Generator().manual_seed(4)
    prompts = _prompts(g, (5, 1, 9, 3))
    seqs, lps = [list(p) for p in prompts], [[] for _ in prompts]
    take = greedy_taker(seqs, lps)
    with torch.inference_mode():
        logits, batch = runner.prefill(prompts)
        assert (logits - _alone_last_logits(model, prompts)).abs().max() <= 1e-5
        rows = [0, 1, 2, 3]
        take(logits, batch, rows)
        for step in range(6):
            if step == 2:  # two prompts join (one longer than the running rows)
                more = _prompts(g, (14, 2))
                seqs += [list(p) for p in more]
                lps += [[], []]
                l2, nb = runner.prefill(more)
                take(l2, nb, [4, 5])
                batch = runner.merge(batch, torch.arange(batch.size), nb)
                rows = rows + [4, 5]
            if step == 4:  # the longest running row and the first leave
                batch = runner.select(batch, torch.tensor([1, 2, 3, 5]))
                rows = [1, 2, 3, 5]
            take(runner.decode(batch), batch, rows)
    for s, lp in zip(seqs, lps):
        ref = reference_logprobs(model, s[:len(s) - len(lp)], s[len(s) - len(lp):], 1.0)
        assert max(abs(a - b) for a, b in zip(ref, lp)) <= 1e-5


@pytest.mark.parametrize("name", list(CONFIGS))
def test_native_forward_equals_transformers(models, name, monkeypatch):
    r = _runner(models[name])
    assert r.native is not None and r.packed is None  # the native path is the one chosen
    # and the one used: transformers' forward is never called
    monkeypatch.setattr(r.model, "forward", lambda *a, **k: pytest.fail("transformers' forward was called"))
    _run_scenario(r, hf_model(models[name]))


@pytest.mark.parametrize("name", ["llama_yarn_bias", "qwen2_bias_tied", "qwen3_qk_norm_head_dim"])
def test_accelerator_kernel_choices_equal_transformers(models, name):
    """The accelerator's code path (separate projections, one-kernel norms, SDPA decode with
    K/V repeated in prefill), run on the CPU: same numbers."""
    from embedded_engine.native_forward import NativeForward

    r = _runner(models[name])
    r.native = NativeForward(r.model, None, accelerator=True)
    assert not r.native.fused and r.native.repeat_kv_prefill and not r.native.matmul_decode_attention
    _run_scenario(r, hf_model(models[name]))


def test_native_forward_with_packed_weights_equals_transformers(models, monkeypatch):
    monkeypatch.setattr(PackedLinears, "MIN_WEIGHT_ELEMENTS", 0)  # pack every (fused) weight of the tiny model
    r = _runner(models["qwen2_bias_tied"])
    if not r.native.packed:
        pytest.skip("this torch build has no oneDNN packed linear")
    calls = []
    orig = torch.ops.mkldnn._linear_pointwise
    try:
        torch.ops.mkldnn._linear_pointwise = lambda *a: calls.append(1) or orig(*a)  # count calls
        _run_scenario(r, hf_model(models["qwen2_bias_tied"]))
        n = len(calls)
        assert n  # the packed matmul ran
        with torch.inference_mode():  # one row: fewer than MIN_ROWS, the layers' own weights
            logits, batch = r.prefill([[9]])
            batch.last_tok = logits.argmax(-1)
            step = r.decode(batch)
        assert len(calls) == n
    finally:
        torch.ops.mkldnn._linear_pointwise = orig
    ref = _alone_last_logits(hf_model(models["qwen2_bias_tied"]), [[9], [9, int(batch.last_tok)]])
    assert (torch.cat([logits, step]) - ref).abs().max() <= 1e-5


def test_unsupported_models_take_transformers_path(models, engine_model, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    gpt2 = _save(GPT2LMHeadModel(GPT2Config(vocab_size=95, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                            bos_token_id=1, eos_token_id=2)), tmp_path / "gpt2", engine_model)
    # a sliding window shorter than the context: the native forward has no window
    windowed = _save(Qwen2ForCausalLM(Qwen2Config(**{**SMALL, "use_sliding_window": True, "sliding_window": 16,
                                                     "max_window_layers": 0})), tmp_path / "qwen2_win", engine_model)
    for path in (gpt2, windowed):
        r = _runner(path)
        assert r.native is None
        with torch.inference_mode():
            logits, _ = r.prefill([[5, 6, 7], [8]])
        assert (logits - _alone_last_logits(hf_model(path), [[5, 6, 7], [8]])).abs().max() <= 1e-5
    assert _runner(models["mistral"], native_forward="off").native is None  # the switch
    with pytest.raises(ValueError, match="native_forward"):  # built in code: the field (the flag on the command line)
        EngineSettings(model_path=str(gpt2), native_forward="on")


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("how", ["foreach_flat", "copy", "data"])
def test_weight_writes_reach_the_native_forward(models, engine_model, tmp_path, how, packed, monkeypatch):
    """After each kind of weight write (engine/weights.py's, and release/resume's new ``.data``)
    the native forward's fused (and packed) weights follow."""
    if packed:
        monkeypatch.setattr(PackedLinears, "MIN_WEIGHT_ELEMENTS", 0)
    a, b = models["qwen2_bias_tied"], _build("qwen2_bias_tied", tmp_path, engine_model, seed=1)
    r = _runner(a)
    if packed and not r.native.packed:
        pytest.skip("this torch build has no oneDNN packed linear")
    prompts = [[5, 9, 14, 3, 22], [40, 41, 8], [17], [7, 7, 30, 12], [60, 2, 33]]  # >= MIN_ROWS rows
    with torch.inference_mode():
        before, _ = r.prefill(prompts)  # the fused/packed weights of model a are built and used
    new = dict(hf_model(b).named_parameters(remove_duplicate=False))
    params = r.named_tensors()
    write_weights(params, new, how)
    with torch.inference_mode():
        after, batch = r.prefill(prompts)
        batch.last_tok = after.argmax(-1)
        step = r.decode(batch)
    ref = hf_model(b)
    assert (after - _alone_last_logits(ref, prompts)).abs().max() <= 1e-5
    assert (before - after).abs().max() > 1e-2  # the two models differ: the check has teeth
    ref_step = _alone_last_logits(ref, [p + [int(t)] for p, t in zip(prompts, batch.last_tok)])
    assert (step - ref_step).abs().max() <= 1e-5
