"""Ray helpers shared by the parts that place actors on the cluster (the rollout manager's engines,
the trainer's ranks). Imports nothing of ours."""
