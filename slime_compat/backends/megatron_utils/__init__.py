"""slime.backends.megatron_utils."""
