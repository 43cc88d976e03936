"""The Sample record: one response to one prompt, with slime's field names.

A *group* is the list of ``n_samples_per_prompt`` samples generated for one prompt. Groups are
what the rollout side pushes into the buffer and what the trainer pulls out of it.

Field names follow slime's ``Sample`` so that users' plugins port unchanged. Lengths obey:
``len(loss_mask) == response_length``, ``len(rollout_log_probs) == response_length`` (when
log-probs are present) and ``response_length <= len(tokens)`` (``tokens`` is prompt + response).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any


class Status(str, enum.Enum):
    """Lifecycle of a sample. ``completed``/``truncated`` are trainable; the others are not."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:
    """One response to one prompt (slime's field names).

    ``prompt`` is a string or a list of chat messages (``[{"role": ..., "content": ...}]``).
    ``reward`` is a float or a dict of named rewards (the trainer reads ``args.reward_key``).
    ``weight_versions`` lists the policy version that produced each generated segment; a
    partial rollout resumed under newer weights appends the new version.
    """

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    reward: float | dict[str, float] | None = None
    status: Status = Status.PENDING
    weight_versions: list[int] = field(default_factory=list)

    # --- derived views -------------------------------------------------------------------
    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens at the front of ``tokens``."""
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    @property
    def oldest_weight_version(self) -> int | None:
        return min(self.weight_versions) if self.weight_versions else None

    def scalar_reward(self, key: str | None = None) -> float:
        """The reward as one float: ``reward[key]`` for dict rewards, else ``reward``."""
        if isinstance(self.reward, dict):
            if key is None:
                raise ValueError(f"sample {self.index}: reward is a dict {sorted(self.reward)}; "
                                 "set --reward-key to pick one")
            return float(self.reward[key])
        if self.reward is None:
            raise ValueError(f"sample {self.index}: reward is missing")
        return float(self.reward)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        unknown = set(d) - SAMPLE_FIELDS
        if unknown:
            raise ValueError(f"unknown Sample field(s): {sorted(unknown)}")
        d = dict(d)
        if "status" in d:
            d["status"] = Status(d["status"])
        return cls(**d)

    def copy(self, **changes: Any) -> "Sample":
        return replace(self, **changes)


SAMPLE_FIELDS = frozenset(f.name for f in fields(Sample))
TRAINABLE = (Status.COMPLETED, Status.TRUNCATED)


def check_sample(sample: Any, where: str = "sample") -> None:
    """Raise ``ValueError`` naming ``where`` and the field if ``sample`` breaks the contract."""
    if not isinstance(sample, Sample):
        raise ValueError(f"{where}: expected a Sample, got {type(sample).__name__}")
    if not isinstance(sample.tokens, list) or not sample.tokens:
        raise ValueError(f"{where}: field 'tokens' is missing or empty")
    if not isinstance(sample.response_length, int) or not 0 <= sample.response_length <= len(sample.tokens):
        raise ValueError(f"{where}: field 'response_length'={sample.response_length!r} is not in "
                         f"[0, len(tokens)={len(sample.tokens)}]")
    if sample.loss_mask is None:
        raise ValueError(f"{where}: field 'loss_mask' is missing")
    if len(sample.loss_mask) != sample.response_length:
        raise ValueError(f"{where}: field 'loss_mask' has length {len(sample.loss_mask)}, "
                         f"response_length is {sample.response_length}")
    if sample.rollout_log_probs is not None and len(sample.rollout_log_probs) != sample.response_length:
        raise ValueError(f"{where}: field 'rollout_log_probs' has length {len(sample.rollout_log_probs)}, "
                         f"response_length is {sample.response_length}")
    if not isinstance(sample.status, Status):
        raise ValueError(f"{where}: field 'status'={sample.status!r} is not a Status")
    if sample.status in TRAINABLE:
        _check_reward(sample.reward, where)
    if not sample.weight_versions:
        raise ValueError(f"{where}: field 'weight_versions' is missing or empty")


def _check_reward(reward: Any, where: str) -> None:
    values = reward.values() if isinstance(reward, dict) else [reward]
    for v in values:
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{where}: field 'reward'={reward!r} is missing or not a number")
        if not math.isfinite(v):
            raise ValueError(f"{where}: field 'reward'={reward!r} is not finite")


def check_group(group: Any, n_samples_per_prompt: int | None, where: str = "group") -> None:
    """Validate one group: a non-empty list of valid samples of the expected size."""
    if not isinstance(group, list) or not group:
        raise ValueError(f"{where}: expected a non-empty list of Samples, got {type(group).__name__}")
    if n_samples_per_prompt is not None and len(group) != n_samples_per_prompt:
        raise ValueError(f"{where}: has {len(group)} samples, expected n_samples_per_prompt="
                         f"{n_samples_per_prompt}")
    for i, s in enumerate(group):
        check_sample(s, f"{where}, sample {i}")


def group_oldest_version(group: list[Sample]) -> int:
    """The oldest policy version that contributed to any sample of the group."""
    return min(v for s in group for v in s.weight_versions)


def flatten(groups: list[list[Sample]]) -> list[Sample]:
    return [s for g in groups for s in g]
