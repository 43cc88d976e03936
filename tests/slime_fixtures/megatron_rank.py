"""Runs in a spawned trainer rank (``tests/_fixtures_megatron.spawn``): two rollout batches on the
Megatron backend with slime's trainer hooks from ``train_hooks`` (``run_megatron``'s batches and
settings)."""

H = "slime_fixtures.train_hooks."
HOOKS = {"custom_megatron_init_path": H + "custom_init", "custom_megatron_before_log_prob_hook_path": H + "before_log_prob",
         "custom_megatron_before_train_step_hook_path": H + "before_train_step",
         "custom_tis_function_path": H + "tis", "custom_pg_loss_reducer_function_path": H + "dr_grpo_reducer"}


def run(ckpt: str, plugin_args: dict) -> dict:
    """The rank's metrics and the reductions the pg-loss reducer made (the module is the one the
    backend loaded: same process)."""
    import slime_compat

    slime_compat.install()  # train_hooks imports slime.*, as slime's plugins do
    from slime_fixtures import train_hooks
    from tests._fixtures_megatron import run_megatron

    out = run_megatron(ckpt, {}, 2, settings_kw={**HOOKS, "plugin_args": plugin_args})
    return {"metrics": out["metrics"], "reduced": list(train_hooks.REDUCED)}
