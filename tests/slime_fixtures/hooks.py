"""slime's step-level hooks: sample filter, all-samples process, data source, log functions."""

from slime.rollout.data_source import RolloutDataSourceWithBuffer

CALLS = {"all_samples": [], "rollout_log": [], "eval_log": []}


def remove_odd_samples(args, samples):
    for group in samples:
        for s in group:
            s.remove_sample = s.index % 2 == 1


def record_all_samples(args, samples, data_source):
    CALLS["all_samples"].append((len(samples), callable(data_source)))


def rollout_log(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    CALLS["rollout_log"].append((rollout_id, len(samples), rollout_time > 0))
    return True  # skip the default logging


def eval_log(rollout_id, args, data, extra_metrics):
    CALLS["eval_log"].append((rollout_id, sorted(data), len(next(iter(data.values()))["rewards"])))
    return False


class TaggedDataSource(RolloutDataSourceWithBuffer):
    def get_samples(self, num_samples):
        groups = super().get_samples(num_samples)
        for g in groups:
            for s in g:
                s.metadata["tagged"] = True
        return groups
