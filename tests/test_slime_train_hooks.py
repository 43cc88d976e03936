"""slime's trainer-side hooks and flags through the launcher users run (``scripts/train.py
--debug-train-only`` on a dumped rollout batch: real Ray trainer ranks, no engines), with plugins
written in slime's style (tests/slime_fixtures/train_hooks.py) that record each call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _fixtures_train import make_groups
from buffer.arrow import write_parquet
from train_backend.losses import kl_penalty

ROOT = Path(__file__).resolve().parents[1]
H = "slime_fixtures.train_hooks."


def _run(toy_model_dir: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    dump = tmp_path / "rollout_{rollout_id}.parquet"
    groups = make_groups(toy_model_dir, num_groups=2, group_size=4)
    for step in (0, 1):
        write_parquet(groups, str(dump).format(rollout_id=step))
    log = tmp_path / "hooks.jsonl"
    cfg = tmp_path / "custom.yaml"
    cfg.write_text(f"hook_log: {log}\nhook_tag: from-yaml\n")
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts/train.py"), "--config", str(ROOT / "examples/toy/grpo_cpu.yaml"),
           "--hf-checkpoint", str(toy_model_dir), "--prompt-data", str(toy_model_dir / "data/train.jsonl"),
           "--no-build-toy-model", "--no-plots", "--output-dir", str(out), "--buffer-name", f"buf-{tmp_path.name}",
           "--num-rollout", "2", "--debug-train-only", "--load-debug-rollout-data", str(dump),
           "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--global-batch-size", "4",
           "--custom-config-path", str(cfg), "--custom-megatron-init-path", H + "custom_init",
           "--custom-megatron-before-log-prob-hook-path", H + "before_log_prob",
           "--custom-megatron-before-train-step-hook-path", H + "before_train_step", *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    events = [json.loads(line) for line in open(log)] if log.exists() else []
    return proc, events


def _train_records(out: Path) -> list[dict]:
    return [r for r in map(json.loads, open(out / "metrics.jsonl")) if "train/loss" in r]


def test_torch_backend_runs_slime_loss_advantage_and_megatron_hooks(toy_model_dir, tmp_path):
    # slime's flags from its run scripts, with their slime meaning
    proc, events = _run(toy_model_dir, tmp_path, "--loss-type", "custom_loss",
                        "--custom-loss-function-path", H + "policy_loss",
                        "--custom-advantage-function-path", H + "advantages",
                        "--custom-reward-post-process-path", H + "recorded_grpo_rewards",
                        "--rollout-data-postprocess-path", H + "recorded_postprocess",
                        "--optimizer", "adam", "--max-tokens-per-gpu", "64", "--use-dynamic-batch-size",
                        "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl",
                        "--kl-coef", "0.00", "--ref-load", str(toy_model_dir), "--attention-dropout", "0.0",
                        "--hidden-dropout", "0.0", "--context-parallel-size", "1", "--attention-softmax-in-fp32",
                        "--accumulate-allreduce-grads-in-fp32", "--recompute-granularity", "full",
                        "--recompute-method", "uniform", "--recompute-num-layers", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    hooks = [e["hook"] for e in events]
    # init once per rank (one rank), with the custom config's attribute and slime's flag value
    assert [e for e in events if e["hook"] == "init"] == [{"hook": "init", "tag": "from-yaml",
                                                         "kl_loss_type": "low_var_kl"}]
    # per rollout: the advantage hook (after the policy's and the reference's log-probs), then the
    # policy's and reference's log-prob hooks of training, then two optimizer steps (8 samples / 4)
    adv = [e for e in events if e["hook"] == "advantage"]
    assert len(adv) == 2 and all(e["n"] == 8 and e["has_ref"] and e["lengths_ok"] for e in adv)
    steps = [(e["rollout_id"], e["step_id"]) for e in events if e["hook"] == "before_train_step"]
    assert steps == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # before them: the reward post-process on the batch's samples, the post-process after the advantages
    assert [(e["n"], e["slime_sample"]) for e in events if e["hook"] == "reward_post_process"] == [(8, "Sample")] * 2
    post = [e for e in events if e["hook"] == "postprocess"]
    assert [(e["rollout_id"], e["n"]) for e in post] == [(0, 8), (1, 8)]
    assert {"advantages", "log_probs", "ref_log_probs", "loss_masks", "rewards"} <= set(post[0]["keys"])
    order = [e["hook"] for e in events if e["hook"] in ("reward_post_process", "advantage", "postprocess")]
    assert order == ["reward_post_process", "advantage", "postprocess"] * 2
    prefixes = [e["prefix"] for e in events if e["hook"] == "before_log_prob"]
    assert prefixes == ["", "ref_", "", "ref_"] * 2
    assert hooks.count("loss") >= 4  # every micro-batch of every optimizer step went through it
    records = _train_records(tmp_path / "out")
    assert len(records) == 2 and all("train/custom_clipfrac" in r and "train/kl" in r for r in records)
    assert all(r["train/optimizer_steps"] == 2.0 for r in records)


def test_megatron_backend_calls_tis_reducer_and_megatron_hooks(toy_model_dir, tmp_path):
    # the launcher hands these flags to the Megatron backend's settings (the wiring the torch run above exercises)
    from scripts.arguments import parse_args
    from train_backend.arguments import settings_from_args

    from slime_fixtures.megatron_rank import HOOKS, run

    args = parse_args(["--config", str(ROOT / "examples/toy/grpo_cpu.yaml"), "--hf-checkpoint", str(toy_model_dir),
                       "--prompt-data", str(toy_model_dir / "data/train.jsonl"),  # parse checks the files
                       "--eval-prompt-data", str(toy_model_dir / "data/eval.jsonl"), "--train-backend", "megatron", "--use-tis", "--attention-backend", "auto",
                       "--expert-model-parallel-size", "1",
                       *[a for flag, path in HOOKS.items() for a in ("--" + flag.replace("_", "-"), path)]])
    settings = settings_from_args(args)
    assert {flag: getattr(settings, flag) for flag in HOOKS} == HOOKS
    # the backend itself, in one spawned gloo rank: slime's call sites get the Megatron objects
    pytest.importorskip("megatron.core")
    from _fixtures_megatron import spawn, train_settings

    log = tmp_path / "hooks.jsonl"
    got = spawn(run, 1, (str(toy_model_dir), {"hook_log": str(log), "hook_tag": "direct"}), tmp_path / "rank")[0]
    events = [json.loads(line) for line in open(log)]
    assert [e for e in events if e["hook"] == "init"] == [{"hook": "init", "tag": "direct", "kl_loss_type": "k3"}]
    steps = [e for e in events if e["hook"] == "before_train_step"]
    assert [(e["rollout_id"], e["step_id"]) for e in steps] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {e["model"] for e in steps} == {"DistributedDataParallel"}
    # per rollout: the policy's log-probs, then the reference's (run_megatron's settings use the KL loss)
    assert [e["prefix"] for e in events if e["hook"] == "before_log_prob"] == ["", "ref_"] * 2
    tis = [e for e in events if e["hook"] == "tis"]
    assert tis and all(e["total_lengths"] for e in tis)
    # the reducer reduced every micro-batch's pg loss: each rollout's 8 samples once, told the --loss-agg convention
    per_token = train_settings(str(toy_model_dir)).loss_agg == "token_mean"
    assert sum(n for n, _ in got["reduced"]) == 2 * 8 and {t for _, t in got["reduced"]} == {per_token}
    assert [m["train/optimizer_steps"] for m in got["metrics"]] == [2.0, 2.0]
    assert all(m["train/custom_tis"] > 0 for m in got["metrics"])  # the TIS plugin's own metric is logged


@pytest.mark.parametrize("extra, msg", [
    (["--kl-coef", "0.1"], "--kl-coef 0.1: in slime this is the KL penalty folded into the rewards"),
    (["--custom-loss-function-path", H + "policy_loss"], "only called with --loss-type custom_loss"),
    (["--loss-type", "custom_loss"], "--loss-type custom_loss needs --custom-loss-function-path"),
    (["--custom-model-provider-path", H + "custom_init"], "the torch backend trains the HF model"),
    (["--context-parallel-size", "2"], "--context-parallel-size=2: only 1 is supported"),
    (["--hidden-dropout", "0.1"], "RL trains without dropout"),
    (["--ref-load", "/nonexistent/torch_dist"], "--ref-load /nonexistent/torch_dist: not an HF checkpoint"),
    (["--recompute-granularity", "selective"], "the torch backend recomputes whole layers"),
    (["--custom-tis-function-path", H + "tis"], "only called with --use-tis"),
    (["--custom-convert-samples-to-train-data-path", H + "train_data_first_token_masked",
      "--custom-reward-post-process-path", H + "grpo_rewards"], "--custom-convert-samples-to-train-data-path replaces"),
])
def test_flags_that_cannot_apply_are_refused_at_start_up(toy_model_dir, tmp_path, extra, msg, capsys):
    from scripts.arguments import parse_args

    argv = ["--config", str(ROOT / "examples/toy/grpo_cpu.yaml"), "--hf-checkpoint", str(toy_model_dir), *extra]
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert msg in capsys.readouterr().err


def test_custom_config_key_naming_a_flag_must_hold_its_value(toy_model_dir, tmp_path, capsys):
    """slime's mis.yaml repeats ``use_tis: true`` beside ``--use-tis``: accepted; a value the flag
    does not have in this run is refused, naming both."""
    from scripts.arguments import parse_args

    base = ["--config", str(ROOT / "examples/toy/grpo_cpu.yaml"), "--hf-checkpoint", str(toy_model_dir),
            "--prompt-data", str(toy_model_dir / "data/train.jsonl"),
            "--eval-prompt-data", str(toy_model_dir / "data/eval.jsonl")]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 0.5\n")
    with pytest.raises(SystemExit):
        parse_args([*base, "--custom-config-path", str(cfg)])
    assert "key 'lr' = 0.5 is the flag --lr, which is 0.0003 in this run" in capsys.readouterr().err
    cfg.write_text("use_tis: true\ntis_mode: truncate\n")
    args = parse_args([*base, "--use-tis", "--custom-config-path", str(cfg)])
    assert args.use_tis is True


def test_low_var_kl_is_slimes_clamped_k3():
    # slime's compute_approx_kl, written out: k3 = exp(-(lp - lb)) - 1 + (lp - lb), clamped to
    # [-10, 10] only for low_var_kl
    lp = torch.tensor([0.0, -1.0, -30.0, 5.0], dtype=torch.float64)
    lb = torch.tensor([0.0, -0.5, -1.0, -20.0], dtype=torch.float64)
    r = -(lp - lb)
    k3 = r.exp() - 1 - r
    assert torch.equal(kl_penalty(lp, lb, "k3"), k3)
    assert torch.equal(kl_penalty(lp, lb, "low_var_kl"), k3.clamp(-10, 10))
    assert kl_penalty(lp, lb, "low_var_kl")[3] == 10.0 and kl_penalty(lp, lb, "k3")[3] > 10


# --- the hooks that shape the rollout batch, against Reservoir's built-in path -------------------
# One SGD step without gradient clipping: the weight change is linear in the advantages, so a hook
# that doubles them must double it, and one that reproduces the built-in path must equal it.

def _sgd_delta(toy_model_dir, groups, **kw) -> dict:
    from _fixtures_train import settings, weights
    from train_backend.interfaces import create_backend

    backend = create_backend(settings(toy_model_dir, optimizer="sgd", lr=0.5, clip_grad=0.0, seed=1, **kw))
    before = weights(backend)
    metrics = backend.train_step(groups, 3)
    return {"delta": {k: v - before[k] for k, v in weights(backend).items()}, "metrics": metrics}


def _assert_deltas(got: dict, want: dict, scale: float = 1.0) -> None:
    for name, d in want.items():
        torch.testing.assert_close(got[name], scale * d, rtol=1e-5, atol=1e-6, msg=name)  # w - w0 of fp32 weights ~1
    assert any(float(d.abs().max()) > 1e-4 for d in want.values())  # the step moved the weights


def test_reward_post_process_convert_and_postprocess_hooks_train_what_they_return(toy_model_dir):
    import slime_compat
    from _fixtures_train import make_groups

    slime_compat.install()  # the fixtures import slime.*, as slime's plugins do
    from slime_fixtures import train_hooks

    groups = make_groups(toy_model_dir, num_groups=2, group_size=4)
    base = _sgd_delta(toy_model_dir, groups)
    # slime's grpo normalisation as a --custom-reward-post-process-path equals the built-in estimator
    _assert_deltas(_sgd_delta(toy_model_dir, groups, custom_reward_post_process_path=H + "grpo_rewards")["delta"],
                   base["delta"])
    # a converter that takes each first response token out of the loss trains as if the samples came so
    masked = [[s.copy(loss_mask=[0] + s.loss_mask[1:]) for s in g] for g in groups]
    want = _sgd_delta(toy_model_dir, masked)
    conv = _sgd_delta(toy_model_dir, groups,
                      custom_convert_samples_to_train_data_path=H + "train_data_first_token_masked")
    _assert_deltas(conv["delta"], want["delta"])
    assert all(g[0].loss_mask[0] == 1 for g in groups)  # the caller's samples were not changed
    # the post-process sees the advantages and masks after the estimator, and what it returns is trained on
    train_hooks.POSTPROCESSED.clear()
    post = _sgd_delta(toy_model_dir, groups, rollout_data_postprocess_path=H + "double_advantages_mask_first_token")
    _assert_deltas(post["delta"], want["delta"], scale=2.0)
    assert train_hooks.POSTPROCESSED == [3]


def test_custom_advantage_loss_and_model_provider_on_megatron_with_tensor_parallelism(toy_model_dir, tmp_path):
    # slime's grpo advantage and a clipped PPO loss written with slime's helpers, on 2 tensor-parallel
    # ranks: the plugin gets the full vocabulary's logits, and training equals the built-in loss; a
    # model provider building the same GPT model trains the same
    pytest.importorskip("megatron.core")
    from _fixtures_megatron import run_layouts, spawn

    plain = dict(backend="megatron", use_kl_loss=False, kl_coef=0.0, entropy_coef=0.0, use_tis=False,
                 global_batch_size=None,
                 optimizer="sgd", lr=0.5, clip_grad=0.0)  # SGD: Adam's first step would amplify rounding
    hooks = dict(plain, loss_type="custom_loss", custom_loss_function_path=H + "ppo_loss",
                 custom_advantage_function_path=H + "grpo_advantages")
    provider = dict(plain, custom_model_provider_path=H + "gpt_provider")
    jobs = [dict(megatron_kw={"tensor_model_parallel_size": 2}, steps=2, settings_kw=kw)
            for kw in (plain, hooks, provider)]
    (builtin, custom, provided), calls = spawn(_megatron_jobs, 2, (str(toy_model_dir), jobs), tmp_path / "ranks")[0]
    assert calls == [(True, True, None)]  # one stage: first and last, no virtual stage
    for name, w in builtin["weights"].items():
        torch.testing.assert_close(custom["weights"][name], w, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(provided["weights"][name], w, rtol=1e-4, atol=1e-6, msg=name)
    for a, b in zip(builtin["metrics"], custom["metrics"]):
        assert a["train/pg_loss"] == pytest.approx(b["train/pg_loss"], rel=1e-4, abs=1e-6)
        assert "train/custom_clipfrac" in b and "train/pg_clipfrac" not in b  # the plugin's own metrics


def _megatron_jobs(ckpt: str, jobs: list) -> tuple[list, list]:
    import slime_compat

    slime_compat.install()
    os.environ["RESERVOIR_TEST_HF"] = ckpt  # read by the model provider
    from _fixtures_megatron import run_layouts

    from slime_fixtures import train_hooks

    return run_layouts(ckpt, jobs), list(train_hooks.PROVIDED)


def test_a_raising_trainer_hook_is_named_and_leaves_the_callers_samples(toy_model_dir):
    import slime_compat
    from _fixtures_train import make_groups

    slime_compat.install()
    groups = make_groups(toy_model_dir, num_groups=1, group_size=4)
    with pytest.raises(RuntimeError, match="--rollout-data-postprocess-path "
                       + H + "raising_postprocess raised KeyError: 'no_such_key'"):
        _sgd_delta(toy_model_dir, groups, rollout_data_postprocess_path=H + "raising_postprocess")
    before = [s.loss_mask[0] for s in groups[0]]
    _sgd_delta(toy_model_dir, groups, rollout_data_postprocess_path=H + "double_advantages_mask_first_token")
    assert [s.loss_mask[0] for s in groups[0]] == before == [1] * 4  # masked on copies only
