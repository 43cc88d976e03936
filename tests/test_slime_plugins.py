"""slime users' plugins run unchanged: plugins written in slime's style (tests/slime_fixtures, importing
``slime.*`` as slime's examples do) through the rollout manager API and ``python -m rollout_manager``,
against instant engines behind the real router. One test per contract:

- imports resolve (slime_compat, without shadowing a real slime), ``Sample`` is the class the plugin
  imports, ``args`` has slime's attributes, ``sample.prompt`` is the templated text;
- a custom generate gets ``evaluation=True`` for eval, may return a list of samples, runs under the
  concurrency limit; a rollout function may return ``RolloutFnTrainOutput`` / ``RolloutFnEvalOutput``;
  ``DynamicFilterOutput`` is honoured (keep, reason);
- a dict reward works with ``--reward-key``; a failing plugin is reported and counted and the run goes
  on; a run in which every sample failed exits non-zero and writes no failed group as kept;
- the hooks ``--data-source-path``, ``--eval-function-path``, ``--rollout-sample-filter-path``,
  ``--rollout-all-samples-process-path``, the log functions (the trainer-side hooks:
  tests/test_slime_train_hooks.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _fixtures_rollout import make_args, running_manager, toy_argv

from buffer.arrow import read_parquet
from buffer.sample import Sample, Status, check_group

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
INSTANT = ["--rollout-engine", "instant", "--rollout-num-engines", "1", "--health-check-interval", "0.5"]


def _argv(model: Path, *extra: str) -> list[str]:
    return toy_argv(model, *INSTANT, "--n-samples-per-prompt", "2", "--rollout-batch-size", "4",
                    "--rollout-max-response-len", "8", *extra)


def _fixture(name: str):
    """A fixture module imported here (the manager imports plugins through plugins.loader, which installs
    the slime import hook; a test reading a fixture's module state directly installs it first)."""
    import importlib

    import slime_compat

    slime_compat.install()
    return importlib.import_module(f"slime_fixtures.{name}")


def _run(argv: list[str], body):
    async def go():
        async with running_manager(argv) as m:
            return await body(m)
    return asyncio.run(go())


# --- A: imports, Sample, args, prompt ------------------------------------------------------------
def test_slime_imports_resolve_to_reservoir_and_sample_is_the_same_class():
    import slime_compat
    from plugins.loader import load_function

    load_function("slime_fixtures.tool_generate.generate", "--custom-generate-function-path")
    import slime.utils.types
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput  # noqa: F401
    from slime.rollout.rm_hub import async_rm, batched_async_rm  # noqa: F401
    from slime.utils.misc import load_function as slime_load

    assert slime_compat.install() and slime.utils.types.Sample is Sample and Sample.Status.COMPLETED is Status.COMPLETED
    assert slime_load("slime_fixtures.rewards.parity") is slime_load("slime_fixtures.rewards.parity")
    with pytest.raises(ModuleNotFoundError, match="slime.agent.*slime_compat"):
        import slime.agent  # noqa: F401  (not provided: named in the error)


def test_slimes_context_parallel_helpers_are_the_one_rank_case():
    """What slime's mis.py imports lazily (``slime.backends.megatron_utils.cp_utils``): without
    context parallelism each rank holds whole sequences, so gathering and slicing hand the values
    back; a slice of the wrong length is refused, as slime asserts."""
    import torch

    import slime_compat

    assert slime_compat.install()
    from slime.backends.megatron_utils.cp_utils import all_gather_with_cp, slice_log_prob_with_cp

    x = torch.arange(5.0)
    assert all_gather_with_cp(x, 9, 5) is x and slice_log_prob_with_cp(x, 9, 5) is x
    assert slice_log_prob_with_cp([0.5, 0.25], 4, 2) == [0.5, 0.25]
    with pytest.raises(ValueError, match="4 values for a response of 5 tokens"):
        slice_log_prob_with_cp(x[:4], 9, 5)


def test_a_real_slime_is_not_shadowed(tmp_path):
    fake = tmp_path / "site" / "slime" / "utils"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("REAL = True\n")
    (fake / "__init__.py").write_text("")
    (fake / "types.py").write_text("class Sample:\n    pass\n")
    code = ("import slime_compat, slime, slime.utils.types as t; from plugins.loader import load_function; "
            "load_function('os.path.join', '--x'); assert not slime_compat.install(); "
            "assert slime.REAL and t.Sample.__module__ == 'slime.utils.types'; print('ok')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_sample_has_slimes_api_and_round_trips_through_arrow():
    from buffer.arrow import groups_to_record_batch, record_batch_to_groups

    s = Sample(index=0, group_index=0, tokens=[1, 2], loss_mask=[], rollout_log_probs=[], weight_versions=[])
    loss_masks = s.loss_mask  # retool keeps this reference and assigns it back at the end: the lists grow in place
    s.append_response_tokens(None, tokens=[3, 4], log_probs=[-0.1, -0.2], trainable=True, text="ab",
                             meta_info={"finish_reason": {"type": "length"}, "weight_version": "5", "cached_tokens": 1,
                                        "prompt_tokens": 2})
    s.append_response_tokens(None, tokens=[9], trainable=False, text="!")
    assert s.status == Sample.Status.TRUNCATED and s.weight_versions == [5] and s.loss_mask == [1, 1, 0]
    assert s.rollout_log_probs == [-0.1, -0.2, 0.0] and s.effective_response_length == 2 and loss_masks is s.loss_mask
    s.reward = {"score": 1.0, "pred": "4"}
    assert s.get_reward_value(type("A", (), {"reward_key": "score"})()) == 1.0
    s.rollout_id, s.session_id, s.train_metadata, s.remove_sample = 7, "abc", {"loss": "sft"}, True
    s.tool_calls = 2  # a plugin's own attribute
    back = record_batch_to_groups(groups_to_record_batch([[s]]))[0][0]
    assert back == s and back.tool_calls == 2 and back.prefix_cache_info.cached_tokens == 1
    assert Sample.from_dict(s.to_dict()) == s
    check_group([s], 1)
    # a fan-out group counts rollout executions (shared rollout_id); a duplicated plain sample is no fan-out
    fan = [s.copy(index=i, rollout_id=i // 2) for i in range(4)]
    check_group(fan, 2)
    with pytest.raises(ValueError, match="n_samples_per_prompt=2"):
        check_group([s.copy(index=0, rollout_id=None), s.copy(index=1, rollout_id=None),
                     s.copy(index=1, rollout_id=None)], 2)


def test_args_prompt_and_a_slime_multiturn_generate_under_the_concurrency_limit(toy_model_dir):
    """search-r1/retool style: GenerateState, post(), append_response_tokens, tool tokens masked,
    args.rollout_max_context_len / sglang_dp_size, the templated prompt; 8 samples on a limit of 1.
    slime's generate_rollout named as the rollout function is the manager's own default rollout
    (registered through the plugin API: progress per group), and post()'s client closes at shutdown."""
    tool_generate = _fixture("tool_generate")
    from slime_compat.utils import http_utils

    argv = _argv(toy_model_dir, "--engine-extra-args", "--num-tokens 3 --delay 0.02", "--sglang-server-concurrency",
                 "1", "--custom-generate-function-path", "slime_fixtures.tool_generate.generate",
                 "--custom-rm-path", "slime_fixtures.tool_generate.reward_func", "--reward-key", "score",
                 "--rollout-max-context-len", "64",
                 "--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout")
    progress = []

    async def body(m):
        out = await m.generate(0, on_group=lambda group, kept: progress.append(kept))
        return out, m.args, id(asyncio.get_running_loop()), id(asyncio.get_running_loop()) in http_utils._clients
    (groups, metrics), args, loop_id, had_client = _run(argv, body)
    assert progress.count(True) == 4  # only the manager's own rollout reports each group
    assert had_client and loop_id not in http_utils._clients  # the on_shutdown hook closed post()'s client
    assert tool_generate.SEEN["max_inflight"] == 1  # slime's generate_and_rm holds the limit around the call
    assert args.rollout_max_prompt_len == 63 and args.over_sampling_batch_size == 4 and args.eval_reward_key == "score"
    tool = len(tool_generate.TOOL_TEXT)  # the toy tokenizer is one token per character
    for g in groups:
        check_group(g, 2)
        for s in g:
            assert s.prompt.startswith("<|user|>") and s.status == Status.COMPLETED
            assert s.loss_mask == [1] * 3 + [0] * tool + [1] * 3 and s.weight_versions == [0, 0]
            assert s.reward["score"] == (1.0 if s.index % 2 == 0 else 0.0) and s.reward["pred"] == "<r>ok</r>"
            assert s.tool_calls == 1 and s.session_id
    assert metrics["rollout/reward_mean"] == 0.5 and metrics["rollout/failed_frac"] == 0


# --- B: contracts ----------------------------------------------------------------------------------
def test_eval_passes_evaluation_true_and_fanout_samples_join_their_group(toy_model_dir, tmp_path):
    tool_generate = _fixture("tool_generate")

    tool_generate.SEEN["evaluation"].clear()
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text("".join(f'{{"prompt": "{i}+1=", "label": "{i + 1}"}}\n' for i in range(3)))
    argv = _argv(toy_model_dir, "--custom-generate-function-path", "slime_fixtures.tool_generate.generate",
                 "--eval-prompt-data", str(eval_data), "--rollout-max-context-len", "64")

    async def body(m):
        await m.generate(0)
        train = list(tool_generate.SEEN["evaluation"])
        metrics = await m.evaluate(0)
        return train, tool_generate.SEEN["evaluation"][len(train):], metrics
    train, evals, metrics = _run(argv, body)
    assert len(train) == 8 and not any(train) and len(evals) == 3 and all(evals)
    assert metrics["eval/num_samples"] == 3

    async def fan(m):
        return await m.generate(0)
    groups, metrics = _run(_argv(toy_model_dir, "--custom-generate-function-path", "slime_fixtures.fanout.generate"),
                           fan)
    assert len(groups) == 4 and metrics["rollout/num_samples"] == 16
    for g in groups:
        check_group(g, 2)  # 4 samples from 2 rollout executions
        assert len(g) == 4 and sorted({s.rollout_id for s in g}) == sorted(s.index for s in g[::2])


def test_rollout_function_returning_slime_output_types(toy_model_dir):
    argv = _argv(toy_model_dir, "--rollout-function-path", "slime_fixtures.rollout_fn.generate_rollout",
                 "--custom-rm-path", "slime_fixtures.rewards.parity")

    async def body(m):
        return await m.generate(0), await m.evaluate(0)
    (groups, metrics), ev = _run(argv, body)
    assert len(groups) == 4 and all(len(g) == 2 for g in groups)
    assert metrics["rollout/my_metric"] == 7 and metrics["rollout/num_samples"] == 8
    assert metrics["rollout/reward_mean"] == 0.25 and ev["eval/toy"] == ev["eval/accuracy"]
    assert "eval/toy-truncated_ratio" in ev


def test_dynamic_filter_output_is_honoured_and_a_crashing_filter_is_counted(toy_model_dir, caplog):
    async def body(m):
        return await m.generate(0)
    groups, metrics = _run(_argv(toy_model_dir, "--over-sampling-batch-size", "8", "--dynamic-sampling-filter-path",
                                 "slime_fixtures.filters.keep_even_groups"), body)
    assert len(groups) == 4 and all(g[0].group_index % 2 == 0 for g in groups)
    assert metrics["rollout/dynamic_filter/drop_odd_group"] == metrics["rollout/dropped_groups"] >= 3

    groups, metrics = _run(_argv(toy_model_dir, "--custom-rm-path", "slime_fixtures.rewards.parity",
                                 "--dynamic-sampling-filter-path",
                                 "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"), body)
    assert all(g[0].group_index % 2 == 0 for g in groups) and metrics["rollout/dynamic_filter/drop_zero_std_0.0"] >= 1

    with caplog.at_level(logging.WARNING):
        groups, metrics = _run(_argv(toy_model_dir, "--dynamic-sampling-filter-path",
                                     "slime_fixtures.filters.crash_on_group_1"), body)
    assert len(groups) == 4 and 1 not in {g[0].group_index for g in groups}
    assert metrics["rollout/failures/filter: ZeroDivisionError"] == 1
    assert "slime_fixtures.filters.crash_on_group_1 failed on group 1" in caplog.text


# --- C: failures -----------------------------------------------------------------------------------
def test_a_failing_generate_is_reported_with_path_and_sample_and_the_run_goes_on(toy_model_dir, caplog):
    async def body(m):
        return await m.generate(0)
    with caplog.at_level(logging.WARNING):
        groups, metrics = _run(_argv(toy_model_dir, "--custom-generate-function-path",
                                     "slime_fixtures.broken_generate.generate"), body)
    assert len(groups) == 4 and metrics["rollout/failures/generate: KeyError"] == 1
    assert "slime_fixtures.broken_generate.generate failed on sample 3" in caplog.text
    assert [s.status for g in groups for s in g].count(Status.FAILED) == 1


def test_sample_hooks_run_in_order_before_the_reward_and_a_failing_one_fails_its_sample(toy_model_dir, caplog):
    hooks = _fixture("sample_hooks")

    async def body(m):
        return await m.generate(5)
    hooks.CALLS.clear()
    groups, metrics = _run(_argv(toy_model_dir, "--rollout-sample-hook-path", "slime_fixtures.sample_hooks.tag",
                                 "--rollout-sample-hook-path", "slime_fixtures.sample_hooks.exclaim",
                                 "--custom-rm-path", "slime_fixtures.sample_hooks.rewards_exclaimed"), body)
    samples = [s for g in groups for s in g]
    assert len(samples) == 8 and all(s.reward == 1.0 and s.metadata["hooked_in_rollout"] == 5 for s in samples)
    for s in samples:  # per sample: the plain hook, then the async one; each got only the keywords it declares
        assert [c for c in hooks.CALLS if c[1] == s.index] == [("tag", s.index, 5), ("exclaim", s.index, False)]
    with caplog.at_level(logging.WARNING):
        groups, metrics = _run(_argv(toy_model_dir, "--rollout-sample-hook-path",
                                     "slime_fixtures.sample_hooks.crash_on_sample_2"), body)
    assert metrics["rollout/failures/sample hook: ValueError"] == 1
    assert [s.status for g in groups for s in g].count(Status.FAILED) == 1
    assert "slime_fixtures.sample_hooks.crash_on_sample_2 failed on sample 2" in caplog.text


def _cli(model: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    cmd = [sys.executable, "-m", "rollout_manager", *_argv(model, *extra), "--output", str(tmp_path / "out.parquet"),
           "--log-dir", str(tmp_path / "logs")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)


def test_cli_dict_reward_and_a_run_where_every_sample_failed(toy_model_dir, tmp_path):
    out = _cli(toy_model_dir, tmp_path, "--custom-generate-function-path", "slime_fixtures.tool_generate.generate",
               "--custom-rm-path", "slime_fixtures.tool_generate.reward_func", "--reward-key", "score",
               "--rollout-max-context-len", "64")
    assert out.returncode == 0, out.stderr[-3000:]
    groups = read_parquet(tmp_path / "out.parquet")
    assert len(groups) == 4 and all(isinstance(s.reward, dict) for g in groups for s in g)
    assert "rollout/reward_mean" in out.stdout

    out = _cli(toy_model_dir, tmp_path, "--custom-rm-path", "slime_fixtures.rewards.always_fails")
    assert out.returncode == 1
    assert "every sample of the first 4 groups failed" in out.stderr and "reward: RuntimeError" in out.stderr
    assert "rollout/failures/reward: RuntimeError" in out.stdout and "wrote 0 groups" in out.stdout
    assert read_parquet(tmp_path / "out.parquet") == []


# --- D: slime's other hooks ------------------------------------------------------------------------
def test_hooks_data_source_sample_filter_all_samples_and_log_functions(toy_model_dir):
    hooks = _fixture("hooks")

    argv = _argv(toy_model_dir, "--data-source-path", "slime_fixtures.hooks.TaggedDataSource",
                 "--rollout-sample-filter-path", "slime_fixtures.hooks.remove_odd_samples",
                 "--rollout-all-samples-process-path", "slime_fixtures.hooks.record_all_samples",
                 "--custom-rollout-log-function-path", "slime_fixtures.hooks.rollout_log",
                 "--eval-function-path", "slime_fixtures.rollout_fn.generate_rollout",
                 "--custom-eval-rollout-log-function-path", "slime_fixtures.hooks.eval_log")

    async def body(m):
        groups, metrics = await m.generate(3)
        state = m.state_dict()
        return groups, metrics, await m.evaluate(3), state
    groups, metrics, ev, state = _run(argv, body)
    assert metrics == {}  # the log function returned True: it did the logging
    assert hooks.CALLS["rollout_log"] == [(3, 8, True)] and hooks.CALLS["all_samples"] == [(4, True)]
    assert hooks.CALLS["eval_log"] == [(3, ["toy"], 4)] and "eval/toy" in ev
    for s in (s for g in groups for s in g):
        assert s.metadata["tagged"] and s.remove_sample == (s.index % 2 == 1)
        assert s.loss_mask == ([0] * s.response_length if s.remove_sample else [1] * s.response_length)
    assert state["data_source"]["source"]["next_group_index"] >= 4


def test_slime_reward_rules():
    _fixture("rewards")  # installs the slime import hook
    from slime.rollout.rm_hub import async_rm
    from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward
    from slime.rollout.rm_hub.math_dapo_utils import compute_score

    assert get_deepscaler_rule_based_reward("<think>..</think> so \\boxed{\\dfrac{1}{2}}", "0.5") == 1
    assert get_deepscaler_rule_based_reward("\\boxed{3}", "3") == 0  # no </think>: slime gives 0
    assert compute_score("... Answer: 7.", "7") == {"score": 1.0, "acc": True, "pred": "7"}
    assert compute_score("... \\boxed{8}", "7", strict_box_verify=True)["score"] == -1.0
    args = type("A", (), {"custom_rm_path": None, "rm_type": "boxed_exact_match"})()
    sample = Sample(response="so \\boxed{yes}", label="yes")
    assert asyncio.run(async_rm(args, sample)) == 1.0 and sample.response == "so \\boxed{yes}"


def test_remote_rm_without_url_is_refused_at_start_up(toy_model_dir):
    with pytest.raises(ValueError, match="--rm-type remote_rm needs --rm-url"):
        make_args(_argv(toy_model_dir, "--rm-type", "remote_rm"))
