"""Reward functions in slime's signature."""


async def always_fails(args, sample, **kwargs):
    raise RuntimeError("reward server down")


async def parity(args, sample, **kwargs):
    return 1.0 if sample.group_index % 2 == 0 and sample.index % 2 == 0 else 0.0
