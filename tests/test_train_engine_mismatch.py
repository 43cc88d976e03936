"""Step 0, end to end: the embedded engine's sampled tokens and log-probs (over its HTTP API)
against the torch backend's log-probs on the same weights. Opens loopback sockets: run under
the loopback-only namespace, as CI does."""

from __future__ import annotations

import json
import urllib.request

import pytest

from buffer.sample import Sample, Status
from train_backend import create_backend

from _fixtures_train import settings

TEMPERATURE = 0.8


def _post(url: str, payload: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def engine(toy_model_dir):
    from embedded_engine import EngineSettings, launch_engine_process

    proc, url = launch_engine_process(EngineSettings(model_path=str(toy_model_dir), port=0, num_threads=1,
                                                     random_seed=0), timeout_s=120)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_engine_and_trainer_log_probs_agree_at_step_0(toy_model_dir, engine):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    samples = []
    for i, q in enumerate(["3+4=", "12+9=", "0+0=", "17+5="]):
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        for j in range(2):
            out = _post(engine + "/generate", {
                "input_ids": ids, "return_logprob": True,
                "sampling_params": {"temperature": TEMPERATURE, "max_new_tokens": 12, "sampling_seed": 10 * i + j}})
            lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
            assert [x[1] for x in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
            samples.append(Sample(index=len(samples), tokens=ids + out["output_ids"],
                                  response_length=len(out["output_ids"]), loss_mask=[1] * len(lps),
                                  rollout_log_probs=lps, reward=float(j), status=Status.COMPLETED,
                                  weight_versions=[0]))
    b = create_backend(settings(toy_model_dir, rollout_temperature=TEMPERATURE, use_tis=True))
    ours = b.compute_log_probs(samples)
    diffs = [abs(a - e) for s, lp in zip(samples, ours) for a, e in zip(lp, s.rollout_log_probs)]
    print(f"engine vs trainer: {len(diffs)} tokens, max |diff| {max(diffs):.2e}")
    assert len(diffs) >= 8 and max(diffs) < 1e-4
    groups = [samples[k:k + 2] for k in range(0, len(samples), 2)]
    m = b.train_step(groups, 0)
    assert m["train/train_rollout_logp_abs_diff"] < 1e-4
    assert m["train/tis_weight"] == pytest.approx(1.0, abs=1e-4)
