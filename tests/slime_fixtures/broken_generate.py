"""A custom generate with a bug on some samples."""

from slime.rollout.sglang_rollout import generate as sglang_generate


async def generate(args, sample, sampling_params):
    if sample.index == 3:
        raise KeyError("tool_result")
    return await sglang_generate(args, sample, sampling_params)
