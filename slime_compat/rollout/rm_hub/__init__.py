"""``slime.rollout.rm_hub``: ``async_rm`` / ``batched_async_rm`` (the reward of a sample as slime's
default rollout computes it), ``remote_rm``, and the graders plugins import.

``async_rm`` follows slime's order: the sample's own ``custom_rm_path``, then ``--custom-rm-path``,
then the rule named by ``sample.metadata["rm_type"]`` or ``--rm-type``, with slime's ``boxed_``
prefix (grade only the last ``\\boxed{}`` of the response). The rules are ``--rm-type``'s
(``plugins/rewards.py``: slime's deepscaler, dapo, f1, gpqa, random and remote_rm, and Reservoir's
math, exact_match, toy_arithmetic and remote); slime's ifbench is not provided (see
``plugins.rewards.REFUSED_RMS``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from buffer.sample import Sample
from plugins.rewards import BUILTIN_RMS, check_rm_type, slime_remote_rm
from slime_compat.rollout.rm_hub.math_utils import extract_answer, grade_answer_verl  # noqa: F401
from slime_compat.utils.misc import load_function

__all__ = ["async_rm", "batched_async_rm", "remote_rm", "grade_answer_verl", "extract_answer"]


async def remote_rm(args: Any, sample: Sample, max_retries: int = 10) -> Any:
    """POST ``{prompt, response, label}`` to ``--rm-url``; the JSON answer as it is."""
    return await slime_remote_rm(args, sample, max_retries)


async def async_rm(args: Any, sample: Sample, **kwargs: Any) -> Any:
    """The reward of one sample (see the module doc for the order)."""
    if sample.custom_rm_path:
        return await load_function(sample.custom_rm_path)(args, sample, **kwargs)
    custom = load_function(args.custom_rm_path) if getattr(args, "custom_rm_path", None) else None
    if custom is not None and custom is not async_rm:  # (--custom-rm-path may name this very function)
        return await custom(args, sample, **kwargs)
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = (metadata.get("rm_type") or getattr(args, "rm_type", None) or "").strip()
    if not rm_type:
        raise NotImplementedError("Rule-based RM type is not specified")
    if rm_type not in BUILTIN_RMS:
        try:
            check_rm_type(rm_type)
        except ValueError as e:  # slime raises NotImplementedError for a type it has no rule for
            raise NotImplementedError(str(e)) from None
    return await BUILTIN_RMS[rm_type](args, sample)


async def batched_async_rm(args: Any, samples: list[Sample], **kwargs: Any) -> list[Any]:
    """Rewards of several samples: one call of a ``--custom-rm-path`` batch function, else ``async_rm`` each."""
    if getattr(args, "custom_rm_path", None):
        return await load_function(args.custom_rm_path)(args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))
