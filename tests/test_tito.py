"""The token-in-token-out validator (rollout_manager/tito.py) on the toy template and SmolLM2's
ChatML: a clean multi-turn sample passes; samples built with each hard and soft defect are caught;
fail mode fails the sample with a counted reason; the CLI reads a saved Parquet of groups."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
from test_chat_append import DROPS_THINK
from transformers import AutoTokenizer

from buffer.arrow import write_parquet
from buffer.sample import Sample, Status
from plugins.chat_append import append_ids, render_ids
from rollout_manager.tito import ENGINE_SPANS, TitoChecker, check_sample, log_chat_turn, main, record_engine_span

PROMPT = [{"role": "user", "content": "What is 12+7?"}]
REPLIES = ["<think>12+7</think><calc>12+7</calc>", "It is 19."]
TOOL = [{"role": "tool", "content": "19"}]


@pytest.fixture(params=["toy", "smollm2"])
def tok(request, toy_model_dir):
    if request.param == "toy":
        return AutoTokenizer.from_pretrained(toy_model_dir)
    return copy.deepcopy(request.getfixturevalue("smollm2_tokenizer"))


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _model_turn(sample, ids, version=0):
    start = len(sample.tokens)
    sample.tokens += ids
    sample.response_length += len(ids)
    sample.loss_mask += [1] * len(ids)
    sample.rollout_log_probs += [-0.5] * len(ids)
    record_engine_span(sample, start, ids, {"prompt_tokens": start, "weight_version": str(version)})


def _env_turn(sample, ids, messages):
    start = len(sample.tokens)
    sample.tokens += ids
    sample.response_length += len(ids)
    sample.loss_mask += [0] * len(ids)
    sample.rollout_log_probs += [0.0] * len(ids)
    log_chat_turn(sample, start, messages)


def clean_sample(tok, prompt_as_text=False, stop=True, tool_content=None):
    """prompt, reply 1 (+ its stop token), tool result (appended), reply 2: as a multi-turn generate builds it."""
    prompt_ids = render_ids(tok, PROMPT, add_generation_prompt=True)
    s = Sample(index=0, group_index=0, prompt=tok.decode(prompt_ids) if prompt_as_text else list(PROMPT),
               tokens=list(prompt_ids), loss_mask=[], rollout_log_probs=[], status=Status.COMPLETED)
    _model_turn(s, _ids(tok, REPLIES[0]) + ([tok.eos_token_id] if stop else []))
    convo = PROMPT + [{"role": "assistant", "content": REPLIES[0]}]
    tool = [{"role": "tool", "content": tool_content}] if tool_content else TOOL
    _env_turn(s, append_ids(tok, convo, tool, ids=s.tokens if stop else None), TOOL)
    _model_turn(s, _ids(tok, REPLIES[1]) + [tok.eos_token_id])
    return s


@pytest.mark.parametrize("prompt_as_text", [False, True])
def test_a_clean_multi_turn_sample_passes(tok, prompt_as_text):
    report = check_sample(clean_sample(tok, prompt_as_text), tok)
    assert (report.hard, report.soft, report.recorded, report.soft_checked) == ([], [], True, True)


def _first_model_token(s):
    return s.metadata[ENGINE_SPANS][0][0]


HARD_DEFECTS = {
    "prompt_mismatch": lambda s: s.metadata[ENGINE_SPANS][1].__setitem__(2, s.metadata[ENGINE_SPANS][1][2] - 1),
    # the first reply re-tokenized after the engine answered: what turn 2's request saw is gone
    "not_append_only": lambda s: s.tokens.__setitem__(_first_model_token(s), s.tokens[_first_model_token(s)] + 1),
    "mask_outside_engine": lambda s: s.loss_mask.__setitem__(s.metadata["chat_turns"][0][0] - s.prompt_length, 1),
    "mask_inside_engine": lambda s: s.loss_mask.__setitem__(0, 0),
}


@pytest.mark.parametrize("kind", HARD_DEFECTS)
def test_each_hard_error_is_caught(tok, kind):
    s = clean_sample(tok)
    HARD_DEFECTS[kind](s)
    report = check_sample(s, tok)
    assert kind in report.hard, report
    assert check_sample(s).hard == report.hard  # hard checks need no tokenizer


def test_a_whole_output_of_an_older_policy_may_be_masked(tok):
    s = clean_sample(tok)
    s.metadata[ENGINE_SPANS][1][3] = 1  # turn 2 came from policy version 1, turn 1 from version 0
    first = s.metadata[ENGINE_SPANS][0]
    s.loss_mask[:first[1] - first[0]] = [0] * (first[1] - first[0])  # --mask-offpolicy-in-partial-rollout
    assert check_sample(s, tok).hard == []


def _missing_close(tok):
    return clean_sample(tok, stop=False)  # stopped on a stop string, the next turn appended without its close


def _boundary_merge(tok):
    s = clean_sample(tok)
    first = s.metadata[ENGINE_SPANS][0]
    out = s.tokens[first[0]:first[1]]
    text = tok.decode(out[:-1])
    split = [t for ch in text for t in _ids(tok, ch)]  # the same text, one token per character
    assert split != out[:-1]
    rebuilt = Sample(index=0, prompt=s.prompt, tokens=s.tokens[:first[0]], loss_mask=[], rollout_log_probs=[],
                     status=Status.COMPLETED)
    _model_turn(rebuilt, split + out[-1:])
    convo = PROMPT + [{"role": "assistant", "content": REPLIES[0]}]
    _env_turn(rebuilt, append_ids(tok, convo, TOOL, ids=rebuilt.tokens), TOOL)
    _model_turn(rebuilt, _ids(tok, REPLIES[1]) + [tok.eos_token_id])
    return rebuilt


def _whitespace(tok):
    return clean_sample(tok, tool_content=" 19 ")  # the environment wrote " 19 ", its turn log says "19"


def _history_rewrite(tok):
    s = clean_sample(tok)
    convo = PROMPT + [{"role": "assistant", "content": REPLIES[0]}] + TOOL + [{"role": "assistant",
                                                                               "content": REPLIES[1]}]
    user = [{"role": "user", "content": "Thanks"}]
    _env_turn(s, append_ids(tok, convo, user, ids=s.tokens), user)
    _model_turn(s, _ids(tok, "ok") + [tok.eos_token_id])
    tok.chat_template = DROPS_THINK  # a template that drops an earlier <think> once a user turn follows
    return s


SOFT_DEFECTS = {"missing_close": _missing_close, "boundary_merge": _boundary_merge, "whitespace": _whitespace,
                "history_rewrite": _history_rewrite}


@pytest.mark.parametrize("kind", SOFT_DEFECTS)
def test_each_soft_difference_is_caught(tok, kind):
    if kind == "boundary_merge" and tok.eos_token == "<eos>":
        pytest.skip("the toy tokenizer is one character a token: test_the_toy_template_sees_a_spelt_out_special...")
    s = SOFT_DEFECTS[kind](tok)
    report = check_sample(s, tok)
    assert kind in report.soft and report.hard == [], report


def test_the_toy_template_sees_a_spelt_out_special_as_a_merge(toy_model_dir):
    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    s = clean_sample(tok)
    last = s.metadata[ENGINE_SPANS][-1]
    spelt = [t for ch in "<eos>" for t in _ids(tok, ch)]
    ids = s.tokens[last[0]:last[1] - 1] + spelt + _ids(tok, "x")  # the model's "<eos>" as characters, then more
    del s.metadata[ENGINE_SPANS][-1]
    s.tokens, s.response_length = s.tokens[:last[0]], s.response_length - (last[1] - last[0])
    s.loss_mask, s.rollout_log_probs = s.loss_mask[:s.response_length], s.rollout_log_probs[:s.response_length]
    _model_turn(s, ids)
    assert "boundary_merge" in check_sample(s, tok).soft


def test_fail_mode_fails_the_sample_with_a_counted_reason(tok):
    counts = Counter()
    bad = clean_sample(tok)
    HARD_DEFECTS["mask_inside_engine"](bad)
    TitoChecker("warn", tokenizer=tok).apply(bad, counts)
    assert bad.status == Status.COMPLETED and counts["mask_inside_engine"] == 1
    TitoChecker("fail", tokenizer=tok).apply(bad, counts)
    assert bad.status == Status.FAILED and bad.metadata["failure_reason"] == "tito: mask_inside_engine"
    assert counts["checked"] == 2
    unrecorded = Sample(tokens=[1, 2], response_length=1, loss_mask=[1], status=Status.COMPLETED)
    TitoChecker("fail").apply(unrecorded, counts)
    assert counts["unrecorded"] == 1 and unrecorded.status == Status.COMPLETED


def test_the_cli_checks_a_saved_parquet(toy_model_dir, tmp_path, capsys):
    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    clean, bad = clean_sample(tok), clean_sample(tok, stop=False)
    HARD_DEFECTS["prompt_mismatch"](bad)
    path = tmp_path / "groups.parquet"
    write_parquet([[clean]], path)
    assert main([str(path), "--hf-checkpoint", str(toy_model_dir)]) == 0
    write_parquet([[clean, bad]], path)
    assert main([str(path), "--hf-checkpoint", str(toy_model_dir)]) == 1
    out = capsys.readouterr().out
    assert "2 samples, 2 checked" in out and "prompt_mismatch" in out and "missing_close" in out
    assert main([str(tmp_path / "missing.parquet")]) == 2
