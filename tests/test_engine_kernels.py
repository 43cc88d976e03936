"""Embedded engine, its own CPU kernels: oneDNN-packed linear layers are used inside the
engine's forwards only, agree with transformers' to float round-off (prefill logits, decode
log-probs), and follow every way the engine changes a weight (in-place copies, flat-view
``_foreach_copy_``, a new ``.data``). The toy model's layers are below the size that the engine
packs, so these tests lower that threshold to reach the packed path. They run transformers'
forward (``native_forward="off"``): the native forward packs its own weights
(tests/test_engine_native.py)."""

from __future__ import annotations

import pytest
import torch

from _fixtures_engine import engine_model, engine_model_b, hf_model, reference_logprobs, write_weights  # noqa: F401
from embedded_engine.model_runner import ModelRunner, PackedLinears
from embedded_engine.settings import EngineSettings

# five rows: every linear of a prefill or decode forward gets >= PackedLinears.MIN_ROWS rows
PROMPTS = [[5, 9, 14, 3, 22], [40, 41, 8], [17], [7, 7, 30, 12], [60, 2, 33]]


@pytest.fixture(autouse=True)
def _pack_every_layer(monkeypatch):
    monkeypatch.setattr(PackedLinears, "MIN_WEIGHT_ELEMENTS", 0)


def _packed_runner(path) -> ModelRunner:
    r = ModelRunner(EngineSettings(model_path=str(path), native_forward="off"))
    if r.packed is None:
        pytest.skip("this torch build has no oneDNN packed linear")
    return r


def _last_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """Reference: each prompt alone through transformers' own forward."""
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([p])).logits[:, -1] for p in prompts])  # [n, V]


def test_packed_linears_are_used_in_engine_forwards_only(engine_model):
    r = _packed_runner(engine_model)
    calls = []
    orig = torch.ops.mkldnn._linear_pointwise
    layer = r.model.get_output_embeddings()
    x = torch.randn(3, layer.in_features)
    with torch.inference_mode():
        plain = layer(x)  # outside the engine's forwards: transformers' path, bit for bit
        assert torch.equal(plain, torch.nn.functional.linear(x, layer.weight))
        try:
            torch.ops.mkldnn._linear_pointwise = lambda *a: calls.append(1) or orig(*a)  # count calls
            logits, _ = r.prefill(PROMPTS)
        finally:
            torch.ops.mkldnn._linear_pointwise = orig
    n_linear = sum(type(m) is torch.nn.Linear for m in r.model.modules())
    assert len(calls) == n_linear  # every linear of the forward took the packed path
    ref = _last_logits(hf_model(engine_model), PROMPTS)
    assert (logits - ref).abs().max() <= 1e-5


def test_packed_decode_logprobs_equal_full_forward(engine_model):
    r = _packed_runner(engine_model)
    prompts = PROMPTS
    seqs = [list(p) for p in prompts]
    lps: list[list[float]] = [[] for _ in prompts]
    with torch.inference_mode():
        logits, batch = r.prefill(prompts)
        for _ in range(6):
            lp = torch.log_softmax(logits, -1)  # [B, V]
            tok = logits.argmax(-1)  # [B]
            for i, t in enumerate(tok.tolist()):
                seqs[i].append(t)
                lps[i].append(lp[i, t].item())
            batch.last_tok = tok
            logits = r.decode(batch)
    model = hf_model(engine_model)
    for p, s, lp in zip(prompts, seqs, lps):
        ref = reference_logprobs(model, p, s[len(p):], 1.0)
        assert max(abs(a - b) for a, b in zip(ref, lp)) <= 1e-5


def test_small_layers_and_tiny_inputs_keep_transformers_linear(engine_model, monkeypatch):
    monkeypatch.setattr(PackedLinears, "MIN_WEIGHT_ELEMENTS", 1 << 40)
    assert ModelRunner(EngineSettings(model_path=str(engine_model), native_forward="off")).packed is None
    monkeypatch.setattr(PackedLinears, "MIN_WEIGHT_ELEMENTS", 0)
    r = _packed_runner(engine_model)
    layer = r.model.get_output_embeddings()
    x = torch.randn(PackedLinears.MIN_ROWS - 1, layer.in_features)  # [rows, in]
    with torch.inference_mode(), r.packed.active():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))


@pytest.mark.parametrize("how", ["foreach_flat", "copy", "data"])
def test_weight_changes_reach_the_packed_layers(engine_model, engine_model_b, how):
    """After each kind of weight write the engine uses the new weights (no stale packed copy)."""
    r = _packed_runner(engine_model)
    new = dict(hf_model(engine_model_b).named_parameters(remove_duplicate=False))
    params = r.named_tensors()
    write_weights(params, new, how)  # the ways engine/weights.py writes weights
    with torch.inference_mode():
        logits, _ = r.prefill(PROMPTS)
    ref_new = _last_logits(hf_model(engine_model_b), PROMPTS)
    ref_old = _last_logits(hf_model(engine_model), PROMPTS)
    assert (logits - ref_new).abs().max() <= 1e-5
    assert (logits - ref_old).abs().max() > 1e-2  # the two models differ: the check has teeth
