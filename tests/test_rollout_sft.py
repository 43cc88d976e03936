"""The SFT rollout (``rollout_manager/sft.py``, slime's ``sft_rollout.generate_rollout``): loss
masks equal to slime's ``MultiTurnLossMaskGenerator`` (written out below), conversations loaded
with bad rows skipped by line, and samples the trainer takes."""

from __future__ import annotations

import argparse
import json

import pytest

from _fixtures_rollout import make_args
from rollout_manager.data_source import DataSource, load_prompts
from rollout_manager.manager import RolloutManager
from rollout_manager.sft import conversation_check, conversation_tokens, generate_rollout

# ChatML with Qwen2.5's default system prompt (what slime's "qwen" mask type strips from each turn)
# (its markers spelled in the toy tokenizer's characters: "<im_start>", "<im_end>")
CHATML = ("{% if messages[0]['role'] != 'system' %}<im_start>system\nYou are helpful.<im_end>\n{% endif %}"
          "{% for m in messages %}<im_start>{{ m['role'] }}\n{{ m['content'] }}<im_end>\n{% endfor %}"
          "{% if add_generation_prompt %}<im_start>assistant\n{% endif %}")
CONVERSATION = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"},
                {"role": "user", "content": "and 2*5?"}, {"role": "assistant", "content": "10", "step_loss_mask": 0},
                {"role": "user", "content": "9-1="}, {"role": "assistant", "content": "8"}]


@pytest.fixture(scope="module")
def tok(toy_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_model_dir)


@pytest.fixture
def chatml(tok):
    saved = tok.chat_template
    tok.chat_template = CHATML
    yield tok
    tok.chat_template = saved


def _slime_qwen_mask(tokenizer, messages):
    """slime 624b824 slime/utils/mask_utils.py lines 15-80 (``MultiTurnLossMaskGenerator`` with
    ``tokenizer_type="qwen"``: ``get_system_message_length`` and ``gen_multi_turn_loss_mask_qwen``),
    written out; ``apply_chat_template(tokenize=True)`` as text then ids without special tokens, as
    Reservoir encodes (the toy tokenizer adds none either way)."""
    def ids(msgs, **kw):
        return tokenizer(tokenizer.apply_chat_template(msgs, tokenize=False, **kw), add_special_tokens=False)["input_ids"]

    def find_all(main, sub):
        return [i for i in range(len(main) - len(sub) + 1) if main[i:i + len(sub)] == sub]

    test = [{"role": "user", "content": "FOR TESTING ONLY"}] * 2
    raw = tokenizer("FOR TESTING ONLY", add_special_tokens=False)["input_ids"]
    templ = ids(test)
    idx_1, idx_2 = find_all(templ, raw)
    end_interval = len(templ) - len(raw) - idx_2
    gen_len = len(ids(test, add_generation_prompt=True)) - len(templ)
    system_len = idx_1 - ((idx_2 - idx_1) - end_interval - len(raw))
    all_ids, all_mask = [], []
    for i, m in enumerate(messages):
        m_ids = ids([m])
        if m["role"] != "system" and i > 0:
            m_ids = m_ids[system_len:]
        mask = [0] * gen_len + [1] * (len(m_ids) - gen_len) if m["role"] == "assistant" else [0] * len(m_ids)
        if m.get("step_loss_mask", 1) != 1:
            mask = [0] * len(m_ids)
        all_ids += m_ids
        all_mask += mask
    return all_ids, all_mask


@pytest.mark.parametrize("template", ["toy", "chatml"])
def test_qwen_mask_equals_slimes_multi_turn_mask(tok, chatml, template):
    if template == "toy":
        chatml.chat_template = __import__("scripts.make_toy_model", fromlist=["x"]).CHAT_TEMPLATE
    got = conversation_tokens(chatml, CONVERSATION, mask_type="qwen")
    assert got == _slime_qwen_mask(chatml, CONVERSATION)
    ids, mask = got
    trained = chatml.decode([t for t, m in zip(ids, mask) if m])
    assert trained.replace("<im_end>\n", "|").replace("<eos>", "|") == "7|8|"  # not "10" (step_loss_mask 0)


def test_toy_row_trains_the_answer_and_its_eos(tok):
    ids, mask = conversation_tokens(tok, [{"role": "user", "content": "12+7="}, {"role": "assistant", "content": "19"}])
    assert tok.decode(ids) == "<|user|>12+7=<|assistant|>19<eos>"
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "19<eos>" and mask[-3:] == [1, 1, 1] and sum(mask) == 3


def test_distill_qwen_mask(tok):
    ids, mask = conversation_tokens(tok, [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}],
                                    mask_type="distill_qwen")
    assert tok.decode(ids) == "<|user|>1+1=<|assistant|>2" and mask == [0] * (len(ids) - 1) + [1]


def _write_rows(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


GOOD = {"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]}
BAD_ROWS = [
    {"prompt": "2+2="},                                                    # line 2: no messages
    {"messages": [{"role": "user", "content": "2+2="}]},                   # line 3: no assistant turn
    {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "4"}]},  # line 4: template
    {"messages": "2+2=4"},                                                 # line 5: not a list of messages
]


def test_bad_rows_are_skipped_by_line_or_refused_with_strict_data(tok, tmp_path, caplog):
    tok.chat_template = tok.chat_template.replace(
        "{% for m in messages %}", "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tool role') }}{% endif %}")
    try:
        path = _write_rows(tmp_path / "sft.jsonl", [GOOD, *BAD_ROWS, GOOD])
        args, settings = make_args(["--hf-checkpoint", "x", "--prompt-data", str(path), "--input-key", "messages"])
        records, report = load_prompts(path, settings.data, tok, conversations=conversation_check(tok, "qwen"))
        assert len(records) == 2 and records[0].prompt == GOOD["messages"]
        reasons = dict(report.skipped)
        assert sorted(reasons) == [2, 3, 4, 5]
        assert reasons[2].startswith("missing key: 'messages'") and reasons[3] == "no assistant turn to train on"
        assert reasons[4].startswith("chat template cannot render the conversation: TemplateError: no tool role")
        assert "line 4: chat template cannot render" in caplog.text
        strict = settings.data.__class__(**{**vars(settings.data), "strict_data": True})
        with pytest.raises(ValueError, match=r"sft.jsonl' line 2: missing key: 'messages'"):
            load_prompts(path, strict, tok, conversations=conversation_check(tok, "qwen"))
    finally:
        tok.chat_template = __import__("scripts.make_toy_model", fromlist=["x"]).CHAT_TEMPLATE


def test_rollout_builds_trainable_samples_and_the_manager_loads_conversations(toy_model_dir, tok, tmp_path):
    from buffer.sample import check_sample

    path = _write_rows(tmp_path / "sft.jsonl", [GOOD, BAD_ROWS[1], {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "5+5="},
                     {"role": "assistant", "content": "10"}]}])
    argv = ["--hf-checkpoint", str(toy_model_dir), "--prompt-data", str(path), "--input-key", "messages",
            "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--rollout-batch-size", "2"]
    args, settings = make_args(argv)
    manager = RolloutManager(settings, args)  # loads the data; starts no engine
    assert manager.rollout_fn is generate_rollout  # slime's path, through slime_compat
    assert manager.data_report.loaded == 2 and manager.data_report.skipped == [(2, "no assistant turn to train on")]
    groups = generate_rollout(argparse.Namespace(**vars(manager.args)), 0, manager.data_source)
    assert [len(g) for g in groups] == [1, 1]
    for g in groups:
        s = g[0]
        check_sample(s, "sft")
        assert s.status == "completed" and s.reward == 0.0 and s.rollout_log_probs is None
        assert s.loss_mask == [1] * s.response_length  # single-turn: the answer and its <eos>
        assert tok.decode(s.tokens[-s.response_length:]) in ("4<eos>", "10<eos>")

    with pytest.raises(ValueError, match="--apply-chat-template: the SFT rollout"):
        bad_args, bad = make_args([*argv, "--apply-chat-template"])
        RolloutManager(bad, bad_args)
    with pytest.raises(ValueError, match="does not evaluate"):
        generate_rollout(args, 0, DataSource(manager.data_source.records, 1), evaluation=True)
