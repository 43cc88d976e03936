"""Packing, micro-batch planning, step splitting, batch preparation, flags and the LR schedule."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from buffer.sample import Sample, Status
from flags import SettingError
from train_backend import TrainSettings
from train_backend.arguments import add_arguments, settings_from_args
from train_backend.batching import (balance, pack, plan_micro_batches, prepare_batch, split_steps,
                                    whiten_advantages)
from train_backend.schedule import learning_rate


def _sample(prompt, resp, reward=1.0, status=Status.COMPLETED, mask=None, logp=None):
    return Sample(tokens=list(prompt) + list(resp), response_length=len(resp),
                  loss_mask=list(mask) if mask is not None else [1] * len(resp), rollout_log_probs=logp,
                  reward=reward, status=status, weight_versions=[0])


def test_pack_layout():
    a = _sample([10, 11], [12, 13, 14], logp=[-1.0, -2.0, -3.0])
    b = _sample([20, 21, 22], [23], mask=[0])
    mb = pack([a, b], [0.5, -1.0])
    assert mb.input_ids.tolist() == [[10, 11, 12, 13, 14, 20, 21, 22, 23]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    # logits at position i predict token i + 1
    assert mb.logit_index.tolist() == [1, 2, 3, 7]
    assert mb.targets.tolist() == [12, 13, 14, 23]
    assert mb.seq_ids.tolist() == [0, 0, 0, 1]
    assert mb.loss_mask.tolist() == [1, 1, 1, 0]
    assert mb.advantages.tolist() == [0.5, 0.5, 0.5, -1.0]
    assert mb.rollout_logp.tolist() == [-1.0, -2.0, -3.0, 0.0] and mb.rollout_mask.tolist() == [1, 1, 1, 0]
    assert [t.tolist() for t in mb.split(torch.arange(4))] == [[0, 1, 2], [3]]
    with pytest.raises(ValueError, match="response_length"):
        pack([_sample([], [1, 2])])


def test_pack_into_rows():
    a, b, c, d = (_sample([1] * (n - 1), [10 + n], reward=0.0) for n in (5, 4, 3, 2))
    mb = pack([a, b, c, d], [1.0, 2.0, 3.0, 4.0], row_len=6, pad_id=0)
    # first-fit decreasing: rows {a}, {b, d}, {c}; each padded to 6 with positions continuing
    assert mb.input_ids.tolist() == [[1, 1, 1, 1, 15, 0], [1, 1, 1, 14, 1, 12], [1, 1, 13, 0, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]]
    assert mb.logit_index.tolist() == [3, 8, 13, 10]  # row * 6 + column, in sample order
    assert mb.targets.tolist() == [15, 14, 13, 12]
    assert mb.seq_ids.tolist() == [0, 1, 2, 3] and mb.advantages.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_plan_micro_batches_respects_the_budget():
    lengths = [5, 9, 3, 7, 2, 8, 20]
    plan = plan_micro_batches(lengths, 10)
    assert sorted(i for b in plan for i in b) == list(range(7))
    for b in plan:
        assert sum(lengths[i] for i in b) <= 10 or len(b) == 1  # an over-long item gets a bin alone
    assert len(plan) <= 6  # first-fit decreasing: 64 tokens in bins of 10 (+ the 20 alone)
    with pytest.raises(ValueError, match="--max-tokens-per-micro-batch"):
        plan_micro_batches(lengths, 0)


def test_balance_and_split_steps():
    parts = balance([10, 1, 1, 1, 9, 2], 2)
    assert sorted(i for p in parts for i in p) == list(range(6))
    loads = [sum([10, 1, 1, 1, 9, 2][i] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= 1
    assert [len(p) for p in balance([3, 3, 3], 4)].count(0) == 1
    assert split_steps(10, 10, None) == [range(0, 10)]
    assert split_steps(16, 16, 4) == [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]
    # 2 of 16 samples skipped: still 4 steps, the 14 trainable spread evenly
    assert [len(r) for r in split_steps(14, 16, 4)] == [4, 4, 3, 3]


def test_prepare_batch_baselines_and_skips():
    ok = [_sample([1, 2], [3], reward=r) for r in (1.0, 0.0)]
    aborted = _sample([1, 2], [3], reward=0.0, status=Status.ABORTED)
    masked = _sample([1, 2], [3, 4], reward=1.0, mask=[0, 0])
    long = _sample([1] * 10, [3], reward=0.0)
    batch = prepare_batch([ok + [aborted, masked, long]], "dr_grpo", None, max_seq_len=8)
    # baseline: mean of the trainable statuses' rewards (1, 0, 1, 0) = .5; the aborted one is out
    assert batch.advantages == [0.5, -0.5]
    assert batch.skipped == {"status": 1, "empty_response": 0, "zero_loss_mask": 1, "too_long": 1}
    assert batch.num_input_samples == 5 and batch.reward_mean == 0.5
    d = _sample([1, 2], [3], reward={"acc": 1.0, "fmt": 0.0})
    with pytest.raises(ValueError, match="--reward-key"):
        prepare_batch([[d]], "grpo", None, None)
    two = [[d, d.copy(reward={"acc": 0.0, "fmt": 1.0})]]
    assert prepare_batch(two, "dr_grpo", "acc", None).advantages == [0.5, -0.5]


def test_whiten_advantages_weighs_samples_by_loss_tokens():
    a = _sample([1], [2, 3, 4], mask=[1, 1, 0])  # 2 loss tokens
    b = _sample([1], [2])  # 1 loss token
    out = whiten_advantages([a, b], [1.0, -2.0])
    tokens = torch.tensor([out[0], out[0], out[1]], dtype=torch.float64)  # [3] the loss tokens
    assert abs(float(tokens.mean())) < 1e-9 and float(tokens.std()) == pytest.approx(1.0, abs=1e-6)


def _parser():
    p = argparse.ArgumentParser()
    add_arguments(p)
    # flags shared with (and defined by) the rollout manager
    p.add_argument("--hf-checkpoint", default="model")
    p.add_argument("--rollout-temperature", type=float, default=1.0)
    p.add_argument("--reward-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollout-max-response-len", type=int, default=64)
    return p


def test_flag_defaults_come_from_the_settings():
    s = settings_from_args(_parser().parse_args([]))
    assert s == TrainSettings(hf_checkpoint="model", plugin_args=s.plugin_args)  # plugin_args: the namespace
    s = settings_from_args(_parser().parse_args(
        ["--advantage-estimator", "gspo", "--eps-clip-high", "0.28", "--eps-clip-c", "3", "--use-kl-loss",
         "--kl-loss-coef", "0.01", "--kl-loss-type", "k2", "--use-tis", "--tis-clip", "1.5",
         "--loss-agg", "seq_mean_token_sum_norm", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
         "--lr-decay-iters", "10", "--train-backend", "torch", "--global-batch-size", "8"]))
    assert (s.advantage_estimator, s.eps_clip_high, s.eps_clip_c, s.kl_loss_type, s.tis_cap) == ("gspo", 0.28, 3.0,
                                                                                                  "k2", 1.5)
    assert s.loss_agg_norm_length == 64  # Dr. GRPO's divisor: the generation budget
    assert (s.lr_warmup_steps, s.lr_decay_steps, s.global_batch_size) == (2, 10, 8)


@pytest.mark.parametrize("argv, flag", [
    (["--eps-clip-c", "0.5"], "--eps-clip-c"),
    (["--lr-decay-style", "cosine"], "--lr-decay-iters"),
    (["--kl-loss-coef", "0.1"], "--use-kl-loss"),
    (["--eps-clip", "1.5"], "--eps-clip"),
    (["--global-batch-size", "0"], "--global-batch-size"),
    (["--min-lr", "1"], "--min-lr"),
    (["--rollout-temperature", "0"], "--rollout-temperature"),
])
def test_bad_flags_raise_value_error_naming_them(argv, flag):
    with pytest.raises(ValueError, match=flag):
        settings_from_args(_parser().parse_args(argv))


def test_lr_schedule():
    s = TrainSettings(hf_checkpoint="m", lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_style="cosine",
                      lr_decay_steps=12)
    assert [learning_rate(s, i) for i in (0, 1)] == [0.5, 1.0]
    assert learning_rate(s, 2) == pytest.approx(1.0)
    assert learning_rate(s, 7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(s, 12) == pytest.approx(0.1) and learning_rate(s, 100) == pytest.approx(0.1)
    lin = TrainSettings(hf_checkpoint="m", lr=1.0, lr_decay_style="linear", lr_decay_steps=4)
    assert [learning_rate(lin, i) for i in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_lr_schedule_wsd_is_megatrons():
    """WSD (Megatron's OptimizerParamScheduler.get_lr): --lr until lr_decay_steps - wsd_decay_steps,
    then each --lr-wsd-decay-style's coefficient of the decay ratio, --min-lr past the end."""
    coeff = {"linear": lambda r: 1.0 - r, "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
             "exponential": lambda r: 2.0 * math.pow(0.5, r) - 1.0, "minus_sqrt": lambda r: 1.0 - math.sqrt(r)}
    for style, f in coeff.items():
        s = TrainSettings(hf_checkpoint="m", lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_style="WSD",
                          lr_decay_steps=12, lr_wsd_decay_steps=4, lr_wsd_decay_style=style)
        assert [learning_rate(s, i) for i in (0, 1)] == [0.5, 1.0]
        assert all(learning_rate(s, i) == 1.0 for i in range(2, 9)), style
        for i in range(9, 13):
            assert learning_rate(s, i) == pytest.approx(0.1 + 0.9 * f((i - 8) / 4)), (style, i)
        assert learning_rate(s, 100) == pytest.approx(0.1)
    assert TrainSettings(hf_checkpoint="m", lr_decay_style="WSD", lr_decay_steps=8,
                         lr_wsd_decay_steps=8).lr_wsd_decay_style == "exponential"  # Megatron's default
    for bad in (None, 0, 9):
        with pytest.raises(SettingError, match="WSD needs 0 < lr_wsd_decay_steps <= lr_decay_steps"):
            TrainSettings(hf_checkpoint="m", lr_decay_style="WSD", lr_decay_steps=8, lr_wsd_decay_steps=bad)
