"""On-policy distillation (``--use-opd --opd-type sglang``) against slime 624b824's own code, in
float64 (tolerance 1e-12):

- ``losses.opd_advantages`` vs ``apply_opd_kl_to_advantages`` (slime/backends/megatron_utils/
  loss.py, lines 663-701): cut out of its module with ``ast`` and run when the slime mirror is on
  this machine (``SLIME_MIRROR``; its module imports Megatron), and a written-out reference of the
  same lines that CI runs (the mirror run checks the reference too);
- the advantages a train step starts from (``batching.begin_train_step``) vs slime's
  ``compute_advantages_and_returns`` (same file, lines 703-876) for grpo written out: the
  group-normalised reward on every token (slime normalises it on the rollout side), minus the OPD
  term, then ``--normalize-advantages`` (slime's ``distributed_masked_whiten``, written out); and
  the ``opd_reverse_kl`` metric (``sum_of_sample_mean`` of the reverse KL, lines 1168-1171);
- the flags' checks (slime's, and what is not built here), each a one-line error naming its flag.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
from pathlib import Path

import pytest
import torch

from buffer.sample import Sample, Status
from train_backend.batching import begin_train_step
from train_backend.losses import opd_advantages
from train_backend.settings import TrainSettings

F64 = torch.float64
MIRROR = Path(os.environ.get("SLIME_MIRROR", "/work/.mirror/THUDM+slime/repo"))
LOSS_PY = "slime/backends/megatron_utils/loss.py"


def _slime_apply_opd():
    """slime's ``apply_opd_kl_to_advantages``, cut out of loss.py with ``ast``; None without the mirror."""
    if not MIRROR.exists():
        return None
    out = subprocess.run(["git", "-C", str(MIRROR), "show", f"HEAD:{LOSS_PY}"], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    node = next(n for n in ast.parse(out.stdout).body
                if isinstance(n, ast.FunctionDef) and n.name == "apply_opd_kl_to_advantages")
    ns: dict = {"torch": torch, "Namespace": argparse.Namespace, "RolloutBatch": dict}
    exec(compile(ast.Module([node], []), f"slime:{LOSS_PY}", "exec"), ns)
    return ns["apply_opd_kl_to_advantages"]


def _ref_apply_opd(args, rollout_data, advantages, student_log_probs):
    """Written out from slime's ``apply_opd_kl_to_advantages`` (loss.py 663-701): in place,
    ``advantages[i] = adv - args.opd_kl_coef * (student[i] - teacher[i])``; the reverse KLs go to
    ``rollout_data["opd_reverse_kl"]``; nothing without student log-probs."""
    if student_log_probs is None:
        return
    teacher = rollout_data.get("teacher_log_probs")
    if teacher is None:
        raise ValueError(f"OPD with opd_type='{args.opd_type}' requires teacher_log_probs, but it is missing.")
    kls = []
    for i, adv in enumerate(advantages):
        kl = student_log_probs[i] - teacher[i]
        advantages[i] = adv - args.opd_kl_coef * kl
        kls.append(kl)
    rollout_data["opd_reverse_kl"] = kls


def _oracles():
    slime = _slime_apply_opd()
    yield pytest.param(_ref_apply_opd, id="written-out")
    yield pytest.param(slime, id="slime-loss.py",
                       marks=pytest.mark.skipif(slime is None, reason="no slime mirror on this machine"))


def _inputs(seed: int = 5):
    """Six responses of 1..9 tokens: per-sample advantages, the student's and the teacher's log-probs."""
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 1, 7, 4, 9, 2]
    adv = torch.randn(len(lengths), generator=g, dtype=F64).tolist()
    student = [(-torch.rand(n, generator=g, dtype=F64) * 3).tolist() for n in lengths]
    teacher = [(-torch.rand(n, generator=g, dtype=F64) * 3).tolist() for n in lengths]
    return lengths, adv, student, teacher


@pytest.mark.parametrize("slime_fn", list(_oracles()))
@pytest.mark.parametrize("coef", [1.0, 0.3])
def test_opd_advantages_equal_slimes_apply_opd_kl_to_advantages(slime_fn, coef):
    lengths, adv, student, teacher = _inputs()
    args = argparse.Namespace(use_opd=True, opd_type="sglang", opd_kl_coef=coef)
    want = [torch.full((n,), a, dtype=F64) for n, a in zip(lengths, adv)]  # slime's grpo returns: A on every token
    data = {"teacher_log_probs": [torch.tensor(t, dtype=F64) for t in teacher]}
    slime_fn(args, data, want, [torch.tensor(s, dtype=F64) for s in student])
    got, kls = opd_advantages(adv, student, teacher, coef)
    for g_, w in zip(got, want):
        assert torch.equal(torch.tensor(g_, dtype=F64), w) or float((torch.tensor(g_, dtype=F64) - w).abs().max()) <= 1e-12
    for k, w in zip(kls, data["opd_reverse_kl"]):
        assert float((k - w).abs().max()) <= 1e-12
    # per-token advantages in (PPO's GAE, a custom advantage function) take the same term
    got_tok, _ = opd_advantages([[a] * n for n, a in zip(lengths, adv)], student, teacher, coef)
    assert got_tok == got
    with pytest.raises(ValueError, match="requires teacher_log_probs"):
        slime_fn(args, {}, want, [torch.tensor(s, dtype=F64) for s in student])


def _groups(lengths, rewards, student, teacher, masks) -> list[list[Sample]]:
    samples = [Sample(group_index=i // 3, index=i, tokens=[5, 6] + [7] * n, response_length=n, loss_mask=m,
                      reward=r, status=Status.COMPLETED, teacher_log_probs=t, weight_versions=[0])
               for i, (n, r, t, m) in enumerate(zip(lengths, rewards, teacher, masks))]
    return [samples[:3], samples[3:]]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("loss_agg", ["seq_mean_token_mean", "token_mean"])
def test_a_train_step_starts_from_slimes_opd_advantages(normalize, loss_agg):
    """begin_train_step with --use-opd: grpo's group-normalised reward on each token, minus
    --opd-kl-coef x (student - teacher), then whitened over the loss tokens with
    --normalize-advantages, equal to slime's compute_advantages_and_returns written out; the
    student's log-probs come from the backend's policy pass (called once, on the trained samples)."""
    lengths, _, student, teacher = _inputs(7)
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    masks = [[1] * n for n in lengths]
    masks[2][1:3] = [0, 0]
    masks[4][0] = 0
    calls = []

    def log_probs(prefix: str, samples: list[Sample]):
        calls.append((prefix, [s.index for s in samples]))
        return [student[s.index] for s in samples]

    s = TrainSettings(hf_checkpoint="x", use_opd=True, opd_type="sglang", opd_kl_coef=0.5,
                      normalize_advantages=normalize, loss_agg=loss_agg)
    start = begin_train_step(_groups(lengths, rewards, student, teacher, masks), s, 0, None, log_probs=log_probs)
    assert calls == [("", list(range(6)))]

    # slime, written out: rewards normalised per group (slime's rollout side, grpo: (r - mean) / (std + 1e-6)),
    # get_grpo_returns broadcasts them to the tokens, apply_opd_kl_to_advantages, distributed_masked_whiten
    r = torch.tensor(rewards, dtype=F64).view(2, 3)
    norm = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    advs = [torch.full((n,), float(a), dtype=F64) for n, a in zip(lengths, norm)]
    data = {"teacher_log_probs": [torch.tensor(t, dtype=F64) for t in teacher]}
    _ref_apply_opd(argparse.Namespace(opd_type="sglang", opd_kl_coef=0.5), data, advs,
                   [torch.tensor(x, dtype=F64) for x in student])
    if normalize:
        flat, m = torch.cat(advs), torch.cat([torch.tensor(x, dtype=F64) for x in masks])
        mean = (flat * m).sum() / m.sum()
        var = ((flat ** 2) * m).sum() / m.sum() - mean ** 2
        var = var * m.sum() / (m.sum() - 1)
        advs = list(torch.split((flat - mean) * torch.rsqrt(var + 1e-8) * m, lengths))
    for got, want, m in zip(start.advantages, advs, masks):
        keep = torch.tensor(m, dtype=torch.bool)  # slime whitens masked tokens too; their loss is masked out
        assert float((torch.tensor(got, dtype=F64)[keep] - want[keep]).abs().max()) <= 1e-12
    kls = data["opd_reverse_kl"]
    mk = [torch.tensor(x, dtype=F64) for x in masks]
    if loss_agg == "token_mean":
        want_kl = sum(float((k * m).sum()) for k, m in zip(kls, mk)) / sum(float(m.sum()) for m in mk)
    else:  # sum_of_sample_mean over the samples, divided by their count
        want_kl = sum(float((k * m).sum() / m.sum()) for k, m in zip(kls, mk)) / len(kls)
    assert abs(start.opd_reverse_kl - want_kl) <= 1e-12


def test_a_sample_without_teacher_log_probs_is_refused_naming_it():
    lengths, _, student, teacher = _inputs()
    teacher = list(teacher)
    teacher[4] = teacher[4][:-1]
    groups = _groups(lengths, [1.0, 0, 0, 1, 0, 0], student, teacher, [[1] * n for n in lengths])
    s = TrainSettings(hf_checkpoint="x", use_opd=True, opd_type="sglang")
    with pytest.raises(ValueError, match=r"sample 4 .*teacher_log_probs for each of its 9 response tokens, got 8"):
        begin_train_step(groups, s, 0, None, log_probs=lambda p, xs: [student[x.index] for x in xs])


@pytest.mark.parametrize("argv,message", [
    (["--use-opd"], "--opd-type must be given with --use-opd"),
    (["--use-opd", "--opd-type", "megatron"], "--opd-type megatron (a teacher model inside the trainer) is not built"),
    (["--opd-kl-coef", "0.5"], "--opd-kl-coef need(s) --use-opd"),
    (["--opd-type", "sglang"], "--opd-type need(s) --use-opd"),
    (["--use-opd", "--opd-type", "sglang"], "--use-opd --opd-type sglang needs the teacher engine"),
    (["--opd-teacher-url", "http://127.0.0.1:9"], "--opd-teacher-url needs --use-opd"),
    (["--use-opd", "--opd-type", "sglang", "--opd-teacher-load", "/nonexistent/teacher"],
     "--opd-teacher-load /nonexistent/teacher: not an HF checkpoint"),
    (["--use-opd", "--opd-type", "sglang", "--opd-teacher-url", "127.0.0.1:9"], "--opd-teacher-url '127.0.0.1:9'"),
])
def test_opd_flags_are_checked_with_a_line_naming_the_flag(toy_model_dir, argv, message, capsys):
    from scripts.arguments import parse

    base = ["--hf-checkpoint", str(toy_model_dir), "--prompt-data", str(toy_model_dir / "data" / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--rm-type", "toy_arithmetic"]
    with pytest.raises(SystemExit):
        parse(base + argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err, err
