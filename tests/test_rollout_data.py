"""Prompt data: validation with line numbers, chat template, shuffle, epochs, resumable position."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rollout_manager.data_source import DataSource, load_prompts
from rollout_manager.settings import DataSettings


@pytest.fixture(scope="module")
def tok(toy_model_dir):
    return AutoTokenizer.from_pretrained(toy_model_dir)


def _write_lines(path, lines: list[bytes]) -> None:
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_bad_lines_are_reported_skipped_and_counted(tmp_path, tok):
    path = tmp_path / "p.jsonl"
    _write_lines(path, [
        json.dumps({"prompt": "1+2=", "label": "3"}).encode(),  # 1 ok
        b'{"prompt": "1+2=", "label": ',  # 2 malformed
        json.dumps({"question": "1+2=", "label": "3"}).encode(),  # 3 missing input key
        json.dumps({"prompt": "   ", "label": "3"}).encode(),  # 4 empty prompt
        b'{"prompt": "\xff\xfe", "label": "3"}',  # 5 not UTF-8
        json.dumps({"prompt": "9" * 50, "label": "3"}).encode(),  # 6 too long
        json.dumps({"prompt": "2+2=", "label": "4", "metadata": {"k": 1}}).encode(),  # 7 ok
        json.dumps({"prompt": "2+2="}).encode(),  # 8 missing label
        json.dumps([1, 2]).encode(),  # 9 not an object
    ])
    settings = DataSettings(rollout_max_prompt_len=20)
    records, report = load_prompts(path, settings, tok)
    assert [r.prompt for r in records] == ["1+2=", "2+2="]
    assert records[1].metadata == {"k": 1}
    reasons = dict(report.skipped)
    assert sorted(reasons) == [2, 3, 4, 5, 6, 8, 9]
    assert reasons[2].startswith("malformed JSON")
    assert reasons[3].startswith("missing key: 'prompt'")
    assert reasons[4].startswith("empty prompt")
    assert reasons[5].startswith("not UTF-8")
    assert reasons[6].startswith("prompt too long: 50 tokens")
    assert reasons[8].startswith("missing key: 'label'")
    assert report.skipped_by_reason["missing key"] == 2


def test_strict_data_raises_with_line_number(tmp_path, tok):
    path = tmp_path / "p.jsonl"
    _write_lines(path, [json.dumps({"prompt": "1+2=", "label": "3"}).encode(), b"{oops"])
    with pytest.raises(ValueError, match=r"--prompt-data .* line 2: malformed JSON.*--strict-data"):
        load_prompts(path, DataSettings(strict_data=True), tok)


def test_no_usable_prompts_and_missing_file(tmp_path, tok):
    path = tmp_path / "p.jsonl"
    _write_lines(path, [b"{oops"])
    with pytest.raises(ValueError, match="no usable prompts"):
        load_prompts(path, DataSettings(), tok)
    with pytest.raises(ValueError, match="no such file"):
        load_prompts(tmp_path / "nope.jsonl", DataSettings(), tok)


def test_chat_template_and_parquet(tmp_path, tok):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"q": ["3+4=", "5+6="], "a": ["7", "11"]}), path)
    records, report = load_prompts(path, DataSettings(input_key="q", label_key="a", apply_chat_template=True), tok)
    assert report.skipped == [] and [r.label for r in records] == ["7", "11"]
    text = tok.apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True, tokenize=False)
    assert records[0].input_ids == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(records[0].input_ids) == "<|user|>3+4=<|assistant|>"


def test_message_list_prompt_needs_chat_template(tmp_path, tok):
    path = tmp_path / "p.jsonl"
    _write_lines(path, [json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "label": "2"}).encode()] * 2)
    with pytest.raises(ValueError, match="--apply-chat-template"):
        load_prompts(path, DataSettings(), tok)
    records, _ = load_prompts(path, DataSettings(apply_chat_template=True), tok)
    assert tok.decode(records[0].input_ids) == "<|user|>1+1=<|assistant|>"


def _source(tok, tmp_path, n=10, **kw) -> DataSource:
    path = tmp_path / "p.jsonl"
    _write_lines(path, [json.dumps({"prompt": f"{i}+0=", "label": str(i)}).encode() for i in range(n)])
    records, _ = load_prompts(path, DataSettings(), tok)
    return DataSource(records, n_samples_per_prompt=3, **kw)


def test_groups_epochs_and_shuffle(tmp_path, tok):
    ds = _source(tok, tmp_path, shuffle=True, seed=7, num_epoch=2)
    groups = ds.get_samples(4)
    assert len(groups) == 4 and all(len(g) == 3 for g in groups)
    g = groups[0]
    assert {s.group_index for s in g} == {0} and [s.index for s in g] == [0, 1, 2]
    assert g[0].tokens == g[1].tokens and g[0].tokens is not g[1].tokens  # independent copies
    rest = ds.get_samples(100)
    assert len(rest) == 16 and ds.exhausted  # 2 epochs of 10 prompts
    first_epoch = [x[0].label for x in (groups + rest)[:10]]
    second_epoch = [x[0].label for x in rest[6:]]
    assert sorted(first_epoch) == sorted(second_epoch) == sorted(str(i) for i in range(10))
    assert first_epoch != [str(i) for i in range(10)]  # shuffled
    assert first_epoch != second_epoch  # a new permutation per epoch
    assert ds.get_samples(3) == []


def test_state_dict_resumes_exactly(tmp_path, tok):
    a = _source(tok, tmp_path, shuffle=True, seed=3)
    a.get_samples(7)
    back = a.get_samples(2)
    back[0][0].response = "partial"
    a.add_samples([back[0]])
    state = json.loads(json.dumps(a.state_dict()))  # it must survive JSON (checkpoints)
    expected = [[s.to_dict() for s in g] for g in a.get_samples(12)]
    b = _source(tok, tmp_path, shuffle=True, seed=3)
    b.load_state_dict(state)
    got = [[s.to_dict() for s in g] for g in b.get_samples(12)]
    assert got == expected
    assert got[0][0]["response"] == "partial"  # given-back groups come first
    c = _source(tok, tmp_path, shuffle=False)
    with pytest.raises(RuntimeError, match="shuffle"):
        c.load_state_dict(state)
