"""--config YAML defaults: the command line wins; bad keys and values name the file, line and flag."""

import argparse

import pytest

from scripts.config import load_config_defaults
from scripts.metrics_log import MetricsLogger, missing_plots, plot_layout, plot_metrics, read_metrics


def parser():
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    p.add_argument("--rollout-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--use-kl-loss", action="store_true")
    p.add_argument("--advantage-estimator", choices=["grpo", "rloo"], default="grpo")
    p.add_argument("--engine-urls", nargs="+", default=[])
    return p


def parse(tmp_path, text, argv=()):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    p = parser()
    p.set_defaults(**load_config_defaults(p, str(cfg)))
    return p.parse_args(list(argv))


def test_yaml_supplies_defaults_and_cli_overrides(tmp_path):
    a = parse(tmp_path, "rollout-batch-size: 16\nlr: 3e-3\nuse_kl_loss: true\nengine-urls: http://a\n")
    assert (a.rollout_batch_size, a.lr, a.use_kl_loss, a.engine_urls) == (16, 3e-3, True, ["http://a"])
    b = parse(tmp_path, "rollout-batch-size: 16\n", ["--rollout-batch-size", "4"])
    assert b.rollout_batch_size == 4


@pytest.mark.parametrize("text,msg", [
    ("lr: 1\nrollout-batchsize: 3\n", r"line 2: unknown flag '--rollout-batchsize'"),
    ("advantage-estimator: ppo\n", r"line 1: --advantage-estimator must be one of"),
    ("use-kl-loss: 1\n", r"line 1: --use-kl-loss expects true or false"),
    ("rollout-batch-size: 2.5\n", r"line 1: --rollout-batch-size expects an integer"),
    ("lr: [1, 2\n", "not valid YAML"),
    ("- a\n- b\n", "expected a mapping"),
])
def test_bad_config_is_named(tmp_path, text, msg):
    with pytest.raises(ValueError, match=msg):
        parse(tmp_path, text)


def test_metrics_log_and_plots(tmp_path):
    log = MetricsLogger(tmp_path, use_tensorboard=True)
    for step in range(3):
        log.log(step, {"rollout/reward_mean": 0.1 * step, "train/loss": float("nan"), "eval/accuracy": 0.5})
    log.close()
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2] and recs[2]["rollout/reward_mean"] == pytest.approx(0.2)
    assert recs[0]["train/loss"] == "nan"  # JSON has no NaN; kept as a string, never dropped
    files = plot_metrics(tmp_path / "metrics.jsonl", tmp_path)
    assert {f.name for f in files} == {"reward.png", "eval_accuracy.png"}
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_plots_put_each_unit_on_its_own_axis_and_merge_equal_lines(tmp_path):
    """Issue 29 item 8: step time (seconds) is not drawn on the tokens/s axis, and train reward
    equal to rollout reward (sync mode) is one line whose legend names both, not a hidden line."""
    records = [{"step": s, "rollout/reward_mean": 0.1 * s, "train/reward_mean": 0.1 * s, "rollout/tokens_per_s": 6000.0,
                "train/tokens_per_s": 9000.0 + s, "perf/step_time": 0.2, "perf/train_time": 0.1,
                "train/train_rollout_kl": 1e-6, "train/train_rollout_logp_abs_diff": 1e-3} for s in range(3)]
    records[2]["train/reward_mean"] = 0.3  # equal at 2 of 3 steps: two lines
    layout = {plot.file: [(panel.ylabel, [label for label, _ in lines]) for panel, lines in panels]
              for plot, panels in plot_layout(records)}
    assert [ylabel for ylabel, _ in layout["throughput.png"]] == ["tokens/s", "seconds per step"]
    assert [len(labels) for _, labels in layout["throughput.png"]] == [2, 2]
    # no reference model: no train/kl panel
    assert [ylabel for ylabel, _ in layout["kl.png"]] == ["train-rollout KL (nats/token)", "|Δ log p| (nats/token)"]
    assert len(layout["reward.png"][0][1]) == 2
    records[2]["train/reward_mean"] = records[2]["rollout/reward_mean"]
    (reward,) = [lines for plot, panels in plot_layout(records) if plot.file == "reward.png" for _, lines in panels]
    assert len(reward) == 1 and "rollout/reward_mean" in reward[0][0] and "train/reward_mean" in reward[0][0]
    log = MetricsLogger(tmp_path)
    for r in records:
        log.log(r["step"], {k: v for k, v in r.items() if k != "step"})
    log.close()
    written = plot_metrics(tmp_path / "metrics.jsonl", tmp_path)
    assert {f.name for f in written} == {"reward.png", "kl.png", "throughput.png"}
    assert all(f.stat().st_size > 0 for f in written)
    assert {p.file for p in missing_plots(written)} == {"eval_accuracy.png", "response_length.png"}


def test_resume_truncates_metrics_and_purges_tensorboard_steps(tmp_path):
    """A run killed after step 4 and resumed from the checkpoint of step 2 logs steps 3 and 4 again:
    metrics.jsonl and what TensorBoard reads hold each step once, with the redone values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path, use_tensorboard=True)
    for step in range(5):
        log.log(step, {"train/loss": float(step)})
    log.close()
    log = MetricsLogger(tmp_path, use_tensorboard=True)  # the resumed run
    assert log.truncate_after(2) == 2
    for step in (3, 4):
        log.log(step, {"train/loss": 10.0 + step})
    log.close()
    assert [(r["step"], r["train/loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == \
        [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]


def test_step_breakdown_derives_each_calls_time_outside_its_part():
    """metric_keys.step_breakdown: the driver's time of a part minus the part's own, and only
    where both are in the record (async mode's steps have no rollout call)."""
    from metric_keys import step_breakdown

    step = {"perf/rollout_time": 0.05, "perf/rollout_push_time": 0.04, "perf/rollout_buffer_calls_time": 0.006,
            "rollout/time_s": 0.03, "perf/train_time": 0.05, "train/step_time_s": 0.045,
            "perf/weight_sync_time": 0.013}  # no perf/weight_push_rank_time: no weight_sync call time
    got = step_breakdown(step)
    assert got == pytest.approx({"perf/rollout_call_time": 0.01, "perf/train_call_time": 0.005,
                                 "perf/rollout_manager_rest_time": 0.004})


def test_sglang_passthrough_keys_become_server_flags(tmp_path, toy_model_dir):
    """A config's ``sglang-`` keys that are not flags of ours pass through to SGLang as on the
    command line (lists as several values, true as the bare flag, false left out); the command
    line's own come after them, so they win; a typo of one of our ``--sglang-`` flags is refused."""
    from scripts.arguments import parse_args
    from scripts.config import passthrough_tokens

    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout-engine: sglang\nrollout-num-gpus: 1\nsglang-attention-backend: triton\nsglang-cuda-graph-bs-decode: [1, 2, 4]\n"
                   "sglang-enable-memory-saver: true\nsglang-disable-radix-cache: false\nsglang-router-request-timeout-secs: 30\n"
                   "sglang-server-concurrency: 64\n")
    p = parser()
    p.add_argument("--sglang-server-concurrency", type=int)
    assert passthrough_tokens(p, str(cfg)) == ["--sglang-attention-backend", "triton", "--sglang-cuda-graph-bs-decode",
                                               "1", "2", "4", "--sglang-enable-memory-saver",
                                               "--sglang-router-request-timeout-secs", "30"]
    args = parse_args(["--config", str(cfg), "--hf-checkpoint", str(toy_model_dir),
                       "--prompt-data", str(toy_model_dir / "data/train.jsonl"), "--sglang-attention-backend", "fa3"])
    assert args.sglang_server_concurrency == 64
    assert args.sglang_args == ["--attention-backend", "triton", "--cuda-graph-bs-decode", "1", "2", "4",
                                "--enable-memory-saver", "--router-request-timeout-secs", "30", "--attention-backend", "fa3"]
    cfg.write_text("sglang-server-concurency: 64\n")
    with pytest.raises(ValueError, match=r"line 1: unknown flag '--sglang-server-concurency' \(did you mean --sglang-server-concurrency"):
        load_config_defaults(p, str(cfg))

def test_the_launcher_process_imports_neither_torch_nor_transformers(tmp_path):
    """What the launcher imports to start a run and log its steps (the actors' classes, the metrics
    log with TensorBoard, a checkpoint) leaves torch and transformers to the processes that compute:
    importing torch was most of the launcher's start-up CPU, serially before Ray starts."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from scripts.components import Run\n"
            "from scripts import checkpoint\n"
            "import buffer, rollout_manager.actor, rollout_manager.engines, train_backend.actor_group\n"
            "from scripts.metrics_log import MetricsLogger\n"
            f"log = MetricsLogger({str(tmp_path)!r}, use_tensorboard=True)\n"
            "log.log(0, {'a': 1.0}); log.truncate_after(0); log.close()\n"
            "checkpoint._set_rng_state(checkpoint._rng_state())\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
