"""The standalone command and the manager against the real embedded engine (the toy model)."""

from __future__ import annotations

import asyncio

import pytest
from _fixtures_rollout import running_manager, toy_argv, wait_inflight
from transformers import AutoTokenizer

from buffer.arrow import read_parquet
from buffer.sample import Status, check_group
from rollout_manager.__main__ import main


def test_cli_writes_parquet_and_summary(toy_model_dir, tmp_path, capsys):
    out = tmp_path / "out.parquet"
    metrics = main(toy_argv(toy_model_dir, "--input-key", "prompt", "--label-key", "label",
                            "--rollout-num-engines", "2", "--n-samples-per-prompt", "2", "--rollout-batch-size", "4",
                            "--rollout-max-response-len", "8", "--num-rollout", "2", "--output", str(out),
                            "--log-dir", str(tmp_path / "logs")))
    captured = capsys.readouterr()
    printed = captured.out
    assert "rollout/reward_mean" in printed and "rollout/tokens_per_s" in printed and f"to {out}" in printed
    groups = read_parquet(out)
    assert len(groups) == 8 and metrics["rollout/num_groups"] == 8
    # issue 29 item 9: the bar's reward is labelled, a mean over every kept group so far, and ends
    # where the summary's does (each step scored all of its samples here); then what ran and where
    assert captured.err.rstrip().endswith(f"mean reward so far {metrics['rollout/reward_mean']:.4f}]"), captured.err
    assert metrics["rollout/failed_frac"] == 0.0
    assert "rollout summary (2 step(s) of 4 prompts x 2 samples; per-step means averaged over the steps" in printed
    assert f"rollout finished: 2 step(s) of 4 prompts x 2 samples; groups in {out}; engine and router logs in " \
           f"{tmp_path / 'logs'}; wall time " in printed
    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    for g in groups:
        check_group(g, 2)
        for s in g:
            # with --apply-chat-template the sample's prompt is the templated text its tokens encode (slime's)
            assert s.prompt.startswith("<|user|>") and s.prompt.endswith("<|assistant|>")
            assert s.tokens[:s.prompt_length] == tok(s.prompt, add_special_tokens=False)["input_ids"]
            assert 1 <= s.response_length <= 8 and all(lp <= 0 for lp in s.rollout_log_probs)
            assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.weight_versions == [0]
            assert s.status == Status.TRUNCATED or s.tokens[-1] == tok.eos_token_id
    assert (tmp_path / "logs" / "router.log").exists()
    for engine_log in ("engine_0.log", "engine_1.log"):  # a clean run logs no traceback, and not the
        # router's gRPC probe (an HTTP/2 preface each engine answers 400 when the router adds it)
        text = (tmp_path / "logs" / engine_log).read_text()
        assert "Traceback" not in text and "Invalid HTTP request" not in text


def test_cli_rejects_bad_combinations(toy_model_dir, capsys):
    with pytest.raises(SystemExit):
        main(toy_argv(toy_model_dir, "--rollout-batch-size", "4"))  # neither --output nor --buffer
    assert "--output FILE and --buffer NAME" in capsys.readouterr().err


@pytest.mark.slow
def test_embedded_engine_killed_mid_rollout(toy_model_dir):
    async def go():
        argv = toy_argv(toy_model_dir, "--rollout-num-engines", "2", "--n-samples-per-prompt", "4",
                        "--rollout-batch-size", "16", "--rollout-max-response-len", "200",
                        "--health-check-interval", "0.5")
        async with running_manager(argv) as m:
            task = asyncio.ensure_future(m.generate(0))
            await wait_inflight(m, 64)
            m.fleet.kill(1)
            groups, metrics = await asyncio.wait_for(task, 120)
            return groups, metrics, list(m.fleet.events)
    groups, metrics, events = asyncio.run(go())
    samples = [s for g in groups for s in g]
    assert len(samples) == 64 and len({s.index for s in samples}) == 64
    assert all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in samples)
    assert metrics["rollout/retries"] >= 1 and "engine 1 removed" in events
