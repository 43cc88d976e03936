"""Plugins written for the tests in slime's style: they import ``slime.*`` exactly as slime's examples
do (``examples/*/generate_with_*.py``, ``slime/rollout/*_hub``) and are passed by path, unchanged."""
