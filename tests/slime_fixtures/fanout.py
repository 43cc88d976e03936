"""A generate that returns several samples per call, as slime's multi-agent example does."""

from copy import deepcopy

from slime.rollout.sglang_rollout import generate as sglang_generate
from slime.utils.types import Sample


async def generate(args, sample: Sample, sampling_params, evaluation=False) -> list[Sample]:
    out = []
    for _ in range(2):
        s = deepcopy(sample)
        out.append(await sglang_generate(args, s, dict(sampling_params)))
    return out
