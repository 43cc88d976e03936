"""The Sample record: one response to one prompt, with slime's field names.

A *group* is the list of ``n_samples_per_prompt`` samples generated for one prompt. Groups are
what the rollout side pushes into the buffer and what the trainer pulls out of it.

``Sample`` is slime's ``slime.utils.types.Sample`` as far as plugins can tell: the same fields,
the nested ``Sample.Status``, ``append_response_tokens``, ``get_reward_value``, ``to_dict`` /
``from_dict`` (``slime_compat`` exposes this very class as ``slime.utils.types.Sample``, so a
plugin's ``isinstance`` checks hold). Lengths obey: ``len(loss_mask) == response_length``,
``len(rollout_log_probs) == response_length`` (when log-probs are present) and
``response_length <= len(tokens)`` (``tokens`` is prompt + response). Two things differ from
slime: ``weight_versions`` holds integers (slime keeps SGLang's strings), and ``Status`` is a
``str`` enum (its members compare equal to their values).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any


#: ``sample.metadata[CORRECT]``: whether the sample's final answer is right (a bool), set by the
#: plugin that knows (an ``--agent-env`` environment through its step's ``info["correct"]``, a reward
#: function, a custom generate). Accuracy metrics read it (``Sample.correctness``) so that a shaped
#: reward (partial credit) does not pass for accuracy; unmarked samples count their reward.
CORRECT = "correct"


class Status(str, enum.Enum):
    """Lifecycle of a sample. ``completed``/``truncated`` are trainable; the others are not."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


def parse_weight_version(value: Any) -> int:
    """SGLang reports the weight version as a string; ``"default"`` (never updated) is version 0."""
    if value is None or value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise RuntimeError(f"engine reported weight_version {value!r}, not an integer") from None


def _int_list(values: Any) -> list[int]:
    if values is None:
        return []
    if hasattr(values, "tolist"):  # a tensor or an array (slime accepts both)
        values = values.tolist()
    return [int(v) for v in values]


def _float_list(values: Any) -> list[float] | None:
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [float(v) for v in values]


@dataclass
class SpecInfo:
    """Speculative-decoding counters of a sample (slime's ``Sample.SpecInfo``)."""

    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0

    @property
    def spec_accept_rate(self) -> float:
        """Accepted draft tokens per drafted token (0.0 when nothing was drafted)."""
        return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num else 0.0

    @property
    def spec_accept_length(self) -> float:
        """Completion tokens per verify step (0.0 before any verify step)."""
        return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct else 0.0

    def add(self, meta_info: dict) -> None:
        """Add the counters from one engine response's ``meta_info`` (a missing key counts 0)."""
        self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
        self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
        self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
        self.completion_token_num += meta_info.get("completion_tokens", 0)

    def to_dict(self) -> dict[str, int]:
        """The counters as a dict keyed by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def from_dict(data: dict) -> "SpecInfo":
        """Inverse of ``to_dict``; a missing counter is 0."""
        return SpecInfo(**{f.name: data.get(f.name, 0) for f in fields(SpecInfo)})


@dataclass
class PrefixCacheInfo:
    """Prefix-cache counters of a sample (slime's ``Sample.PrefixCacheInfo``)."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of prompt tokens served from SGLang's prefix cache (0.0 when none were counted)."""
        return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

    def add(self, meta_info: dict) -> None:
        """Add ``cached_tokens`` and ``prompt_tokens`` from one engine response's ``meta_info``."""
        self.cached_tokens += meta_info.get("cached_tokens", 0)
        self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

    def to_dict(self) -> dict[str, int]:
        """The counters as a dict keyed by field name."""
        return {"cached_tokens": self.cached_tokens, "total_prompt_tokens": self.total_prompt_tokens}

    @staticmethod
    def from_dict(data: dict) -> "PrefixCacheInfo":
        """Inverse of ``to_dict``; a missing counter is 0."""
        return PrefixCacheInfo(data.get("cached_tokens", 0), data.get("total_prompt_tokens", 0))


@dataclass
class Sample:
    """One response to one prompt (slime's field names, attributes and methods).

    ``prompt`` is the text the prompt tokens encode (with ``--apply-chat-template``: the templated
    text, as in slime), or a list of chat messages. ``reward`` is a float or a dict (the trainer
    and the metrics read ``reward[args.reward_key]``; other entries ride along). ``weight_versions``
    lists the policy version that produced each generated segment; a partial rollout resumed under
    newer weights appends the new version.

    The fields after ``weight_versions`` are slime's: plugins read and set them, the buffer keeps
    them (``buffer.arrow``), the rollout honours ``remove_sample`` (its loss mask becomes zeros, as
    slime's training-data conversion does) and ``rollout_id`` (samples of one rollout execution,
    e.g. a custom generate's fan-out, count as one sample of their group). Plugins may also set
    attributes of their own (``sample.tool_call_count = 2``), as in slime.
    """

    Status = Status  # slime's nested ``Sample.Status`` (the same enum as ``buffer.sample.Status``)
    SpecInfo = SpecInfo
    PrefixCacheInfo = PrefixCacheInfo

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
    reward: float | dict[str, Any] | None = None
    status: Status = Status.PENDING
    weight_versions: list[int] = field(default_factory=list)
    # --- slime's other fields -------------------------------------------------------------
    rollout_id: int | None = None  # one rollout execution split into several samples shares one id
    session_id: str | None = None
    train_metadata: dict | None = None
    remove_sample: bool = False  # set by --rollout-sample-filter-path: kept, but no loss
    teacher_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: Any = None
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    # --- derived views -------------------------------------------------------------------
    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens at the front of ``tokens``."""
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        """The generated part of ``tokens`` (its last ``response_length`` tokens)."""
        return self.tokens[self.prompt_length :]

    @property
    def effective_response_length(self) -> int:
        """Response tokens that carry loss (slime's name)."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    @property
    def oldest_weight_version(self) -> int | None:
        """The oldest policy version in ``weight_versions``; None when no segment was generated yet."""
        return min(self.weight_versions) if self.weight_versions else None

    @property
    def execution_id(self) -> int | None:
        """Which rollout execution produced the sample: ``rollout_id``, else ``index``."""
        return self.rollout_id if self.rollout_id is not None else self.index

    def scalar_reward(self, key: str | None = None) -> float:
        """The reward as one float: ``reward[key]`` for dict rewards, else ``reward``."""
        if isinstance(self.reward, dict):
            if key is None:
                raise ValueError(f"sample {self.index}: reward is a dict {sorted(self.reward)}; "
                                 "set --reward-key to pick one")
            if key not in self.reward:
                raise ValueError(f"sample {self.index}: reward dict {sorted(self.reward)} has no "
                                 f"--reward-key {key!r}")
            return float(self.reward[key])
        if self.reward is None:
            raise ValueError(f"sample {self.index}: reward is missing")
        return float(self.reward)

    def correctness(self, key: str | None = None) -> float:
        """The sample's score for accuracy: 1.0 or 0.0 when ``metadata["correct"]`` marks it (a
        bool, see ``CORRECT``), else ``scalar_reward(key)`` (a 0/1 reward is its own accuracy)."""
        mark = self.metadata.get(CORRECT)
        if isinstance(mark, bool):
            return float(mark)
        if mark is not None:
            raise ValueError(f"sample {self.index}: metadata[{CORRECT!r}] is {mark!r}, expected a bool")
        return self.scalar_reward(key)

    def get_reward_value(self, args: Any) -> Any:
        """slime's accessor: ``reward[args.reward_key]`` when ``--reward-key`` is set, else ``reward``."""
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key else self.reward

    # --- building a response (slime's API for custom generate functions) ----------------
    def append_response_tokens(self, args: Any = None, *, tokens: Any = None, log_probs: Any = None,
                               trainable: bool = True, meta_info: dict | None = None, text: str | None = None,
                               update_terminal_info: bool = True) -> None:
        """Append response tokens and keep ``loss_mask`` and ``rollout_log_probs`` aligned (slime's contract).

        Model tokens: ``trainable=True`` with their ``log_probs`` and the engine's ``meta_info``.
        Tool or environment tokens: ``trainable=False`` and no log-probs (loss mask 0, log-prob 0.0).
        With ``meta_info`` carrying a ``finish_reason`` the status follows it (length -> truncated,
        abort -> aborted, stop -> completed) and the segment's ``weight_version`` is recorded.
        """
        tokens = _int_list(tokens)
        log_probs = _float_list(log_probs)
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens require rollout log probabilities")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        before = self.response_length
        # the lists grow in place (+=), as slime's do: plugins keep references to them
        # (retool's ``loss_masks = sample.loss_mask`` ... ``sample.loss_mask = loss_masks``)
        if tokens:
            self.tokens += tokens
            self.response_length += len(tokens)
            if self.loss_mask is None:
                self.loss_mask = [1] * before
            self.loss_mask += [1 if trainable else 0] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError("cannot append trainable rollout log probabilities to a sample with "
                                     "response tokens but no rollout_log_probs")
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs += log_probs
        if meta_info is not None and update_terminal_info and "finish_reason" in meta_info:
            if getattr(args, "sglang_speculative_algorithm", None):
                self.spec_info.add(meta_info)
            self.prefix_cache_info.add(meta_info)
            if "weight_version" in meta_info:
                self.weight_versions.append(parse_weight_version(meta_info["weight_version"]))
            finish = (meta_info["finish_reason"] or {}).get("type")
            if finish in _FINISH_STATUS:
                self.status = _FINISH_STATUS[finish]
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(f"rollout_log_probs length {len(self.rollout_log_probs)} != response_length "
                             f"{self.response_length}")

    # --- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field (and every attribute a plugin added), JSON-friendly: status as its value,
        the counters as dicts, tensors as lists."""
        d = {k: _plain(v) for k, v in vars(self).items()}
        d["status"] = Status(self.status).value
        d["spec_info"] = self.spec_info.to_dict()
        d["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        """Inverse of ``to_dict``; keys that are not fields become attributes (as in slime)."""
        d = dict(d)
        if "status" in d:
            d["status"] = Status(d["status"])
        if isinstance(d.get("spec_info"), dict):
            d["spec_info"] = SpecInfo.from_dict(d["spec_info"])
        if isinstance(d.get("prefix_cache_info"), dict):
            d["prefix_cache_info"] = PrefixCacheInfo.from_dict(d["prefix_cache_info"])
        sample = cls(**{k: v for k, v in d.items() if k in SAMPLE_FIELDS})
        for k, v in d.items():
            if k not in SAMPLE_FIELDS:
                setattr(sample, k, v)
        return sample

    def copy(self, **changes: Any) -> "Sample":
        """A new Sample with ``changes`` applied (``dataclasses.replace``).

        Shallow: lists and dicts are shared with this sample, and attributes a plugin added are not carried over.
        """
        return replace(self, **changes)


_FINISH_STATUS = {"length": Status.TRUNCATED, "abort": Status.ABORTED, "stop": Status.COMPLETED}


def _plain(v: Any) -> Any:
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        return v.tolist()
    return v


SAMPLE_FIELDS = frozenset(f.name for f in fields(Sample))
TRAINABLE = (Status.COMPLETED, Status.TRUNCATED)


def check_sample(sample: Any, where: str = "sample", check_reward: bool = True) -> None:
    """Raise ``ValueError`` naming ``where`` and the field if ``sample`` breaks the contract
    (``check_reward=False``: a sample not scored yet)."""
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
    if check_reward and sample.status in TRAINABLE:
        _check_reward(sample.reward, where)
    if not sample.weight_versions:
        raise ValueError(f"{where}: field 'weight_versions' is missing or empty")


def _check_reward(reward: Any, where: str) -> None:
    """A finite number, or a dict whose numbers are finite and that holds at least one number
    (its other entries, e.g. a parsed answer string, ride along as in slime)."""
    if isinstance(reward, dict):
        numbers = [v for v in reward.values() if _is_number(v)]
        if not numbers:
            raise ValueError(f"{where}: field 'reward'={reward!r} holds no number")
        values = numbers
    else:
        if not _is_number(reward):
            raise ValueError(f"{where}: field 'reward'={reward!r} is missing or not a number")
        values = [reward]
    for v in values:
        if not math.isfinite(v):
            raise ValueError(f"{where}: field 'reward'={reward!r} is not finite")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_group(group: Any, n_samples_per_prompt: int | None, where: str = "group") -> None:
    """Validate one group: a non-empty list of valid samples from ``n_samples_per_prompt`` rollout
    executions. Usually one sample each; a custom generate that returns several samples (slime's
    fan-out) gives them one ``rollout_id``, so they count once (``Sample.execution_id``)."""
    if not isinstance(group, list) or not group:
        raise ValueError(f"{where}: expected a non-empty list of Samples, got {type(group).__name__}")
    if n_samples_per_prompt is not None and len(group) != n_samples_per_prompt \
            and not _fanout_of(group, n_samples_per_prompt):
        raise ValueError(f"{where}: has {len(group)} samples, expected n_samples_per_prompt="
                         f"{n_samples_per_prompt}")
    for i, s in enumerate(group):
        check_sample(s, f"{where}, sample {i}")


def _fanout_of(group: list, n: int) -> bool:
    """Whether ``group`` is ``n`` rollout executions: samples sharing a ``rollout_id`` count once,
    the others (no ``rollout_id``) once each by a distinct ``index``."""
    if not all(isinstance(s, Sample) for s in group):
        return False
    shared = {s.rollout_id for s in group if s.rollout_id is not None}
    alone = [s.index for s in group if s.rollout_id is None]
    return len(alone) == len(set(alone)) and not shared & set(alone) and len(shared) + len(alone) == n


def group_oldest_version(group: list[Sample]) -> int:
    """The oldest policy version that contributed to any sample of the group."""
    return min(v for s in group for v in s.weight_versions)


def flatten(groups: list[list[Sample]]) -> list[Sample]:
    """The samples of all groups as one list, in group order."""
    return [s for g in groups for s in g]
