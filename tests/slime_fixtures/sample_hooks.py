"""slime's ``--rollout-sample-hook-path`` hooks (written for the tests): a plain one that tags the
sample with the rollout id it is given, an async one that changes the response (the reward must see
the change), a reward that checks it, and a hook that fails on one sample."""

CALLS = []


def tag(args, sample, *, rollout_id=None):
    CALLS.append(("tag", sample.index, rollout_id))
    sample.metadata["hooked_in_rollout"] = rollout_id


async def exclaim(args, sample, evaluation=False):
    CALLS.append(("exclaim", sample.index, evaluation))
    sample.response = sample.response + "!"
    return sample


async def rewards_exclaimed(args, sample, **kwargs):
    return 1.0 if sample.response.endswith("!") else 0.0


def crash_on_sample_2(args, sample, **kwargs):
    if sample.index == 2:
        raise ValueError("bad sample")
    return sample
