"""A rollout function of one's own, in the style of slime's sglang_rollout: GenerateState,
generate_and_rm_group, async_utils.run, and slime's output types."""

import asyncio

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime.utils.async_utils import run
from slime.utils.types import Sample


async def _generate(args, groups):
    state = GenerateState(args)
    return await asyncio.gather(*(generate_and_rm_group(args, g, state.sampling_params.copy()) for g in groups))


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    groups = data_source.get_samples(args.rollout_batch_size if not evaluation else 2)
    groups = run(_generate(args, groups))
    if evaluation:
        samples = [s for g in groups for s in g]
        return RolloutFnEvalOutput(data={"toy": {"rewards": [s.reward for s in samples],
                                                 "truncated": [s.status == Sample.Status.TRUNCATED for s in samples],
                                                 "samples": samples}})
    return RolloutFnTrainOutput(samples=groups, metrics={"rollout/my_metric": 7})
