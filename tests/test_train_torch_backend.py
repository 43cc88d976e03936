"""The torch backend on the toy model: log-probs, training, batching, bad input, checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from _fixtures_train import hf_log_probs, make_groups, settings, weights
from buffer.sample import Status
from metric_keys import (TRAIN_BATCHING_TIME, TRAIN_FORWARD_BACKWARD_TIME, TRAIN_LOG_PROB_TIME, TRAIN_OPTIMIZER_TIME,
                         TRAIN_STATS_TIME)
from train_backend import TrainBackend, create_backend
from train_backend.torch_backend import TorchBackend


@pytest.fixture(scope="module")
def groups(toy_model_dir):
    return make_groups(toy_model_dir, num_groups=4, group_size=8, logp_noise=0.05)


def _clone(groups):
    return [[s.copy(tokens=list(s.tokens), loss_mask=list(s.loss_mask)) for s in g] for g in groups]


def test_step0_log_probs_match_an_hf_forward(toy_model_dir, groups):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(toy_model_dir)
    samples = [s for g in groups for s in g][:12]
    # short ones too, so that several sequences share a packed row (rows are as long as the longest)
    samples += [s.copy(tokens=s.tokens[-(s.response_length + 2):]) for s in samples[:4]]
    for max_tokens in (10_000, 40):  # one packed row, and many small micro-batches
        b = create_backend(settings(toy_model_dir, rollout_temperature=0.7, max_tokens_per_micro_batch=max_tokens))
        assert isinstance(b, TorchBackend) and isinstance(b, TrainBackend)
        got = b.compute_log_probs(samples)
        for s, lp in zip(samples, got):
            assert len(lp) == s.response_length
            assert torch.allclose(torch.tensor(lp), torch.tensor(hf_log_probs(ref, s, 0.7)), atol=1e-5)


def test_train_step_metrics(toy_model_dir, groups):
    b = create_backend(settings(toy_model_dir, use_tis=True))
    m = b.train_step(groups, 0)
    for key in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm", "lr", "tokens_per_s",
                "train_rollout_logp_abs_diff", "train_rollout_kl", "tis_weight", "num_samples"):
        assert math.isfinite(m[f"train/{key}"]), key
    assert m["train/num_samples"] == 32 and m["train/optimizer_steps"] == 1
    assert m["train/grad_norm"] > 0 and m["train/tokens_per_s"] > 0 and m["train/lr"] == 1e-3
    # step 0: same weights as the (noisy) engine; the mismatch is the injected noise, ~0.04 mean |diff|
    assert 0.01 < m["train/train_rollout_logp_abs_diff"] < 0.1
    assert m["train/ppo_kl"] == 0 and m["train/pg_clipfrac"] == 0  # one step: old == current


def test_training_moves_probability_toward_positive_advantages(toy_model_dir, groups):
    b = create_backend(settings(toy_model_dir, lr=3e-3))
    samples = [s for g in groups for s in g]

    def score():  # mean response log-prob of rewarded minus unrewarded samples
        lps = b.compute_log_probs(samples)
        good = [sum(lp) for s, lp in zip(samples, lps) if s.reward == 1]
        bad = [sum(lp) for s, lp in zip(samples, lps) if s.reward == 0]
        return sum(good) / len(good) - sum(bad) / len(bad)

    before = score()
    for step in range(5):
        b.train_step(groups, step)
    assert score() > before + 0.5


def test_micro_batching_and_global_batch_do_not_change_one_step(toy_model_dir, groups):
    # adam_eps >> |grad| makes Adam's first update ~ lr * grad (not ~ lr * sign(grad), which would
    # blow float round-off on near-zero gradients up to full-size differences)
    a = create_backend(settings(toy_model_dir, max_tokens_per_micro_batch=10_000, lr=1.0, adam_eps=1.0))
    c = create_backend(settings(toy_model_dir, max_tokens_per_micro_batch=40, lr=1.0, adam_eps=1.0))
    ma, mc = a.train_step(groups, 0), c.train_step(groups, 0)
    assert ma["train/loss"] == pytest.approx(mc["train/loss"], abs=1e-6)
    wa, wc = weights(a), weights(c)
    assert all(torch.allclose(wa[k], wc[k], atol=1e-6) for k in wa)


def test_global_batch_size_gives_several_optimizer_steps(toy_model_dir, groups):
    b = create_backend(settings(toy_model_dir, global_batch_size=8, lr=1e-2))
    m = b.train_step(groups, 0)
    assert m["train/optimizer_steps"] == 4 and b.optimizer_steps == 4
    # later steps see a policy that moved since the rollout: old and current log-probs differ
    assert m["train/ppo_kl"] != 0 and m["train/pg_clipfrac"] > 0
    # the step's time split (metric_keys): every phase ran (old log-probs: several optimizer
    # steps), and the phases add up to the step's time, less what follows the last phase
    phases = [TRAIN_BATCHING_TIME, TRAIN_LOG_PROB_TIME, TRAIN_FORWARD_BACKWARD_TIME, TRAIN_OPTIMIZER_TIME,
              TRAIN_STATS_TIME]
    assert all(m[p.key] > 0 for p in phases), {p.key: m.get(p.key) for p in phases}
    assert 0.5 * m["train/step_time_s"] <= sum(m[p.key] for p in phases) <= m["train/step_time_s"]


def test_kl_loss_against_the_frozen_reference(toy_model_dir, groups):
    b = create_backend(settings(toy_model_dir, use_kl_loss=True, kl_coef=0.1, kl_loss_type="k3", lr=1e-2))
    ref_before = {k: v.clone() for k, v in b.ref_model.state_dict().items()}
    m0 = b.train_step(groups, 0)
    m1 = b.train_step(groups, 1)
    assert m0["train/kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference at step 0
    assert m1["train/kl"] > 0
    assert all(torch.equal(v, b.ref_model.state_dict()[k]) for k, v in ref_before.items())


def test_bad_input_is_counted_and_skipped_never_nan(toy_model_dir, groups):
    g = _clone(groups[:2])
    g[0][0].status = Status.ABORTED
    g[0][1] = g[0][1].copy(tokens=g[0][1].tokens[:-g[0][1].response_length], response_length=0, loss_mask=[],
                           rollout_log_probs=[])
    g[0][2].loss_mask = [0] * g[0][2].response_length
    s = g[1][0]
    pad = [5] * 300  # longer than the toy model's 256-token context
    g[1][0] = s.copy(tokens=pad + s.tokens)
    b = create_backend(settings(toy_model_dir))
    m = b.train_step(g, 0)
    assert (m["train/skipped_status"], m["train/skipped_empty_response"], m["train/skipped_zero_loss_mask"],
            m["train/skipped_too_long"]) == (1, 1, 1, 1)
    assert m["train/num_samples"] == 12 and all(math.isfinite(v) for v in m.values())


def test_a_batch_with_nothing_trainable_skips_the_step(toy_model_dir, groups):
    g = _clone(groups[:1])
    for s in g[0]:
        s.loss_mask = [0] * s.response_length
    b = create_backend(settings(toy_model_dir))
    before = weights(b)
    m = b.train_step(g, 0)
    assert m["train/skipped_step"] == 1 and m["train/skipped_zero_loss_mask"] == 8
    assert all(math.isfinite(v) for v in m.values())
    assert all(torch.equal(before[k], v) for k, v in weights(b).items())


def test_malformed_samples_raise_value_error(toy_model_dir, groups):
    b = create_backend(settings(toy_model_dir))
    g = _clone(groups[:1])
    g[0][0].loss_mask = g[0][0].loss_mask[:-1]
    with pytest.raises(ValueError, match="loss_mask"):
        b.train_step(g, 0)
    g = _clone(groups[:1])
    g[0][0].response_length = len(g[0][0].tokens)
    g[0][0].loss_mask = [1] * len(g[0][0].tokens)
    g[0][0].rollout_log_probs = None
    with pytest.raises(ValueError, match="no prompt token"):
        b.train_step(g, 0)
    with pytest.raises(ValueError, match="non-empty list"):
        b.train_step([], 0)


def test_non_finite_weights_raise_instead_of_stepping(toy_model_dir, groups):
    b = create_backend(settings(toy_model_dir))
    with torch.no_grad():
        b.model.lm_head.weight[3, 0] = float("nan")
    before = weights(b)
    with pytest.raises(RuntimeError, match="non-finite"):
        b.train_step(groups, 0)
    assert all(p.grad is None for p in b.model.parameters())  # nothing left for the next step
    after = weights(b)
    assert all(torch.equal(before[k], after[k]) for k in before if torch.isfinite(before[k]).all())


def test_save_load_resumes_exactly(toy_model_dir, groups, tmp_path):
    s = settings(toy_model_dir, lr_warmup_steps=3)
    a = create_backend(s)
    a.train_step(groups, 0)
    a.save(str(tmp_path / "ckpt"))
    a.train_step(groups, 1)
    b = create_backend(s)
    b.load(str(tmp_path / "ckpt"))
    assert b.optimizer_steps == 1 and b.optimizer.param_groups[0]["lr"] == pytest.approx(a.settings.lr * 2 / 3)
    b.train_step(groups, 1)
    wa, wb = weights(a), weights(b)
    assert all(torch.allclose(wa[k], wb[k], atol=1e-7) for k in wa)
    with pytest.raises(RuntimeError, match="not a torch-backend checkpoint"):
        b.load(str(tmp_path))


def test_export_hf_and_named_weights(toy_model_dir, groups, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    b = create_backend(settings(toy_model_dir))
    b.train_step(groups, 0)
    b.export_hf(str(tmp_path / "hf"))
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").eos_token == "<eos>"
    named = weights(b)
    sd = m.state_dict()
    assert set(named) == set(sd)
    assert all(torch.equal(named[k], sd[k]) for k in named)
    s = groups[0][0]
    assert torch.allclose(torch.tensor(b.compute_log_probs([s])[0]), torch.tensor(hf_log_probs(m, s)), atol=1e-5)


def test_bf16_compute_keeps_float32_masters(toy_model_dir, groups, tmp_path):
    from transformers import AutoModelForCausalLM

    b = create_backend(settings(toy_model_dir, dtype="bfloat16", lr=1e-6, use_kl_loss=True, kl_coef=0.01))
    before = {k: v.detach().clone() for k, v in b.model.named_parameters()}
    m = b.train_step(groups, 0)
    assert all(math.isfinite(v) for v in m.values())
    assert all(p.dtype == torch.float32 for p in b.model.parameters())
    # an update of lr 1e-6 is far below bf16's resolution (~1e-2 relative): only float32 masters keep it
    moved = [k for k, p in b.model.named_parameters() if not torch.equal(p.detach(), before[k])]
    assert len(moved) == len(before)
    assert all(t.dtype == torch.bfloat16 for _, t in b.named_hf_weights())
    b.export_hf(str(tmp_path / "hf"))
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").dtype == torch.bfloat16
