"""``slime.backends.megatron_utils.cp_utils``: slime's context-parallel helpers, which TIS functions
written for slime call (its ``examples/train_infer_mismatch_helper/mis.py``). Reservoir's trainers
run without context parallelism, so each rank holds whole sequences and these are slime's
one-rank case."""

from __future__ import annotations

from typing import TypeVar

import torch

T = TypeVar("T", list, torch.Tensor)


def all_gather_with_cp(tensor: torch.Tensor, total_length: int, response_length: int) -> torch.Tensor:
    """A sequence's per-response-token values gathered over the context-parallel ranks: with one
    rank, the values themselves (``[response_length]``)."""
    return tensor


def slice_log_prob_with_cp(log_prob: T, total_length: int, response_length: int) -> T:
    """This rank's part of a sequence's per-response-token values: with one rank, all of them.
    ``ValueError`` when there are not ``response_length`` of them (slime asserts the same)."""
    if len(log_prob) != response_length:
        raise ValueError(f"slice_log_prob_with_cp: {len(log_prob)} values for a response of {response_length} "
                         f"tokens (total length {total_length})")
    return log_prob
