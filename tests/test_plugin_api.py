"""The public plugin API (rollout_manager/plugin_api.py) and the rollout manager's plugin table."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from plugins.loader import load_function
from rollout_manager import plugin_api
from rollout_manager.generate import generate as default_generate
from rollout_manager.manager import load_plugins
from rollout_manager.plugin_api import (StepState, current_context, current_step, is_default_rollout,
                                        note_weight_versions, on_shutdown, recording_weight_versions,
                                        register_default_rollout, run_shutdown_hooks, seen_weight_versions,
                                        set_context, set_step)
from rollout_manager.rollout import generate_rollout
from rollout_manager.settings import PluginSettings


def test_context_and_step_reach_started_tasks_but_not_a_new_thread():
    ctx = object()  # the accessors hand back whatever the manager set

    async def main():
        with pytest.raises(RuntimeError, match="no rollout context"):
            current_context()
        assert current_context(None) is None and current_step(None) is None
        step = StepState(rollout_id=3)
        set_context(ctx)
        set_step(step)

        async def read():
            return current_context(), current_step()
        assert await asyncio.ensure_future(read()) == (ctx, step)  # a task copies them when it starts
        seen = {}

        def thread():  # a thread of the plugin's own starts without them, until it sets them
            seen["before"] = current_context(None)
            set_context(ctx)
            seen["after"] = current_context()
        t = threading.Thread(target=thread)
        t.start()
        t.join()
        assert seen == {"before": None, "after": ctx}
        return current_step().rollout_id
    assert asyncio.run(main()) == 3


def test_weight_versions_are_noted_only_inside_a_recording():
    note_weight_versions({"meta_info": {"weight_version": "4"}})  # outside a generate call: nothing to note
    assert seen_weight_versions() == []
    with recording_weight_versions() as seen:
        note_weight_versions({"meta_info": {"weight_version": "default"}})
        note_weight_versions([{"meta_info": {"weight_version": "2"}}, {"meta_info": {}}, "text",
                              {"meta_info": {"weight_version": "not-a-version"}}])
        assert seen_weight_versions() == [0, 2] and seen == [0, 2]
        seen_weight_versions().append(9)  # a copy
        assert seen == [0, 2]
    assert seen_weight_versions() == []


def test_default_rollout_registrations_are_found_without_sys_modules():
    assert is_default_rollout(generate_rollout)
    slime_rollout = load_function("slime.rollout.sglang_rollout.generate_rollout", "--rollout-function-path")
    assert is_default_rollout(slime_rollout) and slime_rollout is not generate_rollout

    def mine(args, rollout_id, data_source, evaluation=False):
        return generate_rollout(args, rollout_id, data_source, evaluation)
    assert not is_default_rollout(mine)
    try:
        assert register_default_rollout(mine) is mine and register_default_rollout(mine) is mine
        assert is_default_rollout(mine) and plugin_api._default_rollouts.count(mine) == 1
    finally:
        plugin_api._default_rollouts.remove(mine)


def test_shutdown_hooks_run_in_order_sync_and_async_and_a_failing_one_does_not_stop_the_rest(monkeypatch, caplog):
    monkeypatch.setattr(plugin_api, "_shutdown_hooks", [])
    ran = []

    @on_shutdown
    async def first():
        ran.append("first")

    def broken():
        raise OSError("already closed")

    on_shutdown(broken)
    on_shutdown(lambda: ran.append("third"))
    on_shutdown(first)  # registered once
    with caplog.at_level(logging.ERROR, logger="rollout_manager.plugin_api"):
        asyncio.run(run_shutdown_hooks())
    assert ran == ["first", "third"]
    assert any("shutdown hook" in r.getMessage() and "broken" in r.getMessage() for r in caplog.records)


def test_the_plugin_table_defaults_shares_the_eval_function_and_names_each_flag():
    plugins, paths = load_plugins(PluginSettings())
    assert plugins["generate_fn"] is default_generate
    assert plugins["eval_fn"] is plugins["rollout_fn"] is generate_rollout
    assert plugins["sample_hooks"] == [] and plugins["filter_fn"] is None and plugins["eval_log_fn"] is None
    assert paths == {"--rollout-function-path": "rollout_manager.rollout.generate_rollout",
                     "--eval-function-path": "rollout_manager.rollout.generate_rollout"}
    same = PluginSettings(eval_function_path="rollout_manager.rollout.generate_rollout",
                          rollout_sample_hook_path=["os.path.join", "os.path.samefile"])
    plugins, _ = load_plugins(same)
    assert plugins["eval_fn"] is plugins["rollout_fn"]
    assert [path for path, _ in plugins["sample_hooks"]] == ["os.path.join", "os.path.samefile"]
    with pytest.raises(ValueError, match=r"^--rollout-sample-hook-path 'os.getcwd': signature"):
        load_plugins(PluginSettings(rollout_sample_hook_path=["os.getcwd"]))
    with pytest.raises(ValueError, match=r"^--custom-eval-rollout-log-function-path 'asyncio.sleep'"):
        load_plugins(PluginSettings(custom_eval_rollout_log_function_path="asyncio.sleep"))
