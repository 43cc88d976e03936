"""Dynamic-sampling filters returning slime's DynamicFilterOutput."""

from slime.rollout.filter_hub.base_types import DynamicFilterOutput


def keep_even_groups(args, samples, **kwargs):
    keep = samples[0].group_index % 2 == 0
    return DynamicFilterOutput(keep=keep, reason=None if keep else "odd_group")


def crash_on_group_1(args, samples, **kwargs):
    if samples[0].group_index == 1:
        raise ZeroDivisionError("bad group")
    return DynamicFilterOutput(keep=True)
