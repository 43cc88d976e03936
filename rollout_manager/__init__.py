"""The rollout manager: engines, the router, prompt data, the rollout function and rewards.

Run it alone (``python -m rollout_manager --help``) to debug generation and rewards without a
trainer, or from the launcher (``manager.RolloutManager`` in-process, ``actor.RolloutManagerActor``
as a Ray actor) to feed the buffer. The modules, in the order data flows through them:

- ``settings`` / ``arguments``: typed settings and slime-named flags (``add_arguments``,
  ``settings_from_args``, ``split_sglang_args`` for the ``--sglang-*`` pass-through);
- ``data_source``: jsonl/Parquet prompts, validated line by line; groups over epochs, resumable;
- ``engines`` / ``placement`` / ``router``: start, monitor and restart engines (embedded, SGLang,
  or ``embedded_engine.instant``, the benchmark stand-in), locally or in Ray placement groups, behind the
  real sglang-router;
- ``plugin_api``: what plugins reach of the manager (the current context and step, the weight
  versions a sample's requests saw, default-rollout and shutdown registrations);
- ``generate``: the default per-sample generate (token in, token out; retries; partial rollout);
- ``agent``: the agent loop (``--agent-env``: multi-turn episodes with an environment, a custom
  generate; its turn log in the samples' metadata is ``buffer.agent_turns``);
- ``rollout``: the default rollout function (groups, rewards, dynamic-sampling filter,
  over-sampling, aborts);
- ``rewards``: reward dispatch (built-ins in ``plugins.rewards``, remote, custom);
- ``summary``: the ``rollout/...`` and ``eval/...`` metrics;
- ``manager`` / ``actor`` / ``__main__``: the manager, its Ray actor, the standalone command.

Importing this package is cheap: nothing heavy is imported until a module is.
"""
