"""Embedded engine, split prefill: prompts of mixed lengths run as forwards of similar lengths
(less padding than one forward padded to the longest), and the joined batch is exact: every
log-prob equals a full forward over that row alone, through decode steps, a join and a leave."""

from __future__ import annotations

import pytest
import torch

from _fixtures_engine import engine_model, greedy_taker, hf_model, reference_logprobs  # noqa: F401  (fixtures)
from embedded_engine.model_runner import ModelRunner
from embedded_engine.settings import EngineSettings


@pytest.fixture(scope="module")
def runner(engine_model) -> ModelRunner:
    return ModelRunner(EngineSettings(model_path=str(engine_model)))


def test_length_groups_trade_padding_against_forwards(runner, monkeypatch):
    monkeypatch.setattr(runner, "split_cost_tokens", 3)
    monkeypatch.setattr(runner, "PREFILL_MIN_TOKENS", 0)
    assert runner.length_groups([2, 2, 2, 30]) == [[0, 1, 2], [3]]  # 36 tokens + 2 forwards < 120 + 1
    # {4}, {5, 6}, {7, 8}: 12 + 36 + 48 tokens + 3 forwards, the least of all splits
    assert runner.length_groups([4, 5, 6, 7, 8] * 3) == [[0, 5, 10], [1, 6, 11, 2, 7, 12], [3, 8, 13, 4, 9, 14]]
    assert runner.length_groups([7, 7, 7]) == [[0, 1, 2]]
    monkeypatch.setattr(runner, "PREFILL_MIN_TOKENS", 32)  # small forwards count as 32 tokens
    assert runner.length_groups([6, 6, 6, 6, 7, 7, 7, 8]) == [list(range(8))]  # 64 + 3 < 49 + 32 + 6
    assert runner.length_groups([2, 2, 2, 30]) == [[0, 1, 2], [3]]  # 32 + 32 + 6 < 120 + 3
    monkeypatch.setattr(runner, "split_cost_tokens", 1000)  # a forward costs more than any padding here
    assert runner.length_groups([2, 2, 2, 30]) == [[0, 1, 2, 3]]
    monkeypatch.setattr(runner, "split_cost_tokens", None)  # accelerator: never split
    assert runner.length_groups([2, 30]) == [[0, 1]]
    # the toy model's forward costs more than its tokens: it never splits small batches
    assert ModelRunner.PREFILL_FORWARD_FLOP / 2 / sum(p.numel() for p in runner.model.parameters()) > 100


def test_split_prefill_then_decode_join_and_leave_stay_exact(runner, engine_model, monkeypatch):
    monkeypatch.setattr(runner, "split_cost_tokens", 0)  # one forward per distinct length
    monkeypatch.setattr(runner, "PREFILL_MIN_TOKENS", 0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(7, runner.vocab_size, (n,), generator=g).tolist() for n in (3, 12, 3, 7, 1)]
    assert len(runner.length_groups([len(p) for p in prompts])) == 4
    seqs, lps = [list(p) for p in prompts], [[] for _ in prompts]
    take = greedy_taker(seqs, lps)

    with torch.inference_mode():
        logits, batch = runner.prefill(prompts)
        assert batch.valid.sum(1).tolist() == [len(p) for p in prompts]  # rows in prompt order
        rows = list(range(len(prompts)))
        take(logits, batch, rows)
        for step in range(6):
            if step == 2:  # two more prompts (split again) join the running batch
                more = [torch.randint(7, runner.vocab_size, (n,), generator=g).tolist() for n in (20, 2)]
                seqs += [list(p) for p in more]
                lps += [[], []]
                l2, nb = runner.prefill(more)
                take(l2, nb, [5, 6])
                batch = runner.merge(batch, torch.arange(batch.size), nb)
                rows = rows + [5, 6]
            if step == 4:  # rows 1 and 5 (the longest) leave
                batch = runner.select(batch, torch.tensor([0, 2, 3, 4, 6]))
                rows = [0, 2, 3, 4, 6]
            take(runner.decode(batch), batch, rows)
    model = hf_model(engine_model)
    for s, lp in zip(seqs, lps):
        ref = reference_logprobs(model, s[:len(s) - len(lp)], s[len(s) - len(lp):], 1.0)
        assert max(abs(a - b) for a, b in zip(ref, lp)) <= 1e-5
