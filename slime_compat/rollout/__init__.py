"""``slime.rollout``: the rollout helpers slime plugins import."""
