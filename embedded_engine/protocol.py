"""Request parsing and validation for ``/generate`` (field names from SGLang's ``io_struct.py``
``GenerateReqInput`` and ``sampling_params.py``).

Every problem raises ``ProtocolError`` naming the offending field; the server turns it into an
HTTP 400 and keeps serving. Fields SGLang accepts but this engine does not implement are accepted
only at their neutral value (e.g. ``repetition_penalty: 1.0``), so a client never silently gets
behaviour it did not ask for.

SGLang's batch form of ``/generate`` is accepted too (``parse_generate_request``): ``input_ids`` as a
list of lists or ``text`` as a list; ``rid`` absent, one string (element ``i`` gets
``f"{rid}_{i}"``, as SGLang's ``GenerateReqInput`` expands it) or a list; ``sampling_params`` one
dict (shared) or a list; ``return_logprob`` a bool or a list. Each element becomes an ordinary
request; errors name the element (``input_ids[2]: ...``, ``sampling_params[1].top_p: ...``).
"""

from __future__ import annotations

import itertools
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from sglang_protocol.client import batch_rids

# SGLang treats temperatures below this as greedy (top_k = 1, logprobs at temperature 1).
SAMPLING_EPS = 1e-6
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
# request ids for requests without a rid: unique per process (a counter is cheaper than uuid4
# per request, which reads os.urandom)
_RID_PREFIX = uuid.uuid4().hex[:12] + "-"
_RID_COUNTER = itertools.count()


class ProtocolError(ValueError):
    """A bad request; ``field`` names the offending field (the message starts with it)."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (SGLang's names and defaults)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


@dataclass
class GenerateInput:
    """A validated ``/generate`` request (exactly one of ``text`` / ``input_ids`` was given)."""

    rid: str
    input_ids: list[int] | None
    text: str | None
    params: SamplingParams
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    # SGLang's: with return_logprob, the prompt positions from here on get input_token_logprobs
    # (-1: none); with max_new_tokens 0 the request only scores its prompt (a teacher's use)
    logprob_start_len: int = -1
    # SGLang's: the lora_name of a loaded adapter that generates this request (None: the base model)
    lora_path: str | None = None
    extra: dict = field(default_factory=dict)


# Accepted only at these neutral values (SGLang implements them; this engine does not).
_NEUTRAL_SAMPLING = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                     "min_new_tokens": 0, "json_schema": None, "regex": None, "ebnf": None,
                     "structural_tag": None, "logit_bias": None, "custom_params": None}
_IGNORED_SAMPLING = {"stream_interval"}  # transport hints without effect on the result
_NEUTRAL_TOP = {"stream": False, "top_logprobs_num": 0, "token_ids_logprob": None, "image_data": None,
                "video_data": None, "audio_data": None, "session_params": None,
                "custom_logit_processor": None, "return_hidden_states": False, "input_embeds": None,
                "return_routed_experts": False,
                # sglang-router (0.3.2) forwards these with their defaults on every request
                "background": False, "return_bytes": False, "return_entropy": False}
_IGNORED_TOP = {"log_metrics", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                "data_parallel_rank", "priority", "modalities", "extra_key", "no_logs", "routed_dp_rank",
                "model"}  # sglang-router adds "model": null to every request it forwards


def _num(d: dict, name: str, kind: type, default: Any, path: str) -> Any:
    v = d.get(name, default)
    if v is None:
        return default
    # bool is an int subclass in Python: reject it where a number is expected
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise ProtocolError(f"{path}{name}", f"expected {kind.__name__}, got {v!r}")
    if isinstance(v, float) and not math.isfinite(v):
        raise ProtocolError(f"{path}{name}", f"must be finite, got {v!r}")
    return kind(v)


def _flag(d: dict, name: str, default: bool, path: str) -> bool:
    v = d.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ProtocolError(f"{path}{name}", f"expected a boolean, got {v!r}")
    return v


def _int_list(v: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise ProtocolError(name, "expected a list of integer token ids")
    bad = [t for t in v if not 0 <= t < vocab_size]
    if bad:
        raise ProtocolError(name, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return v


def parse_sampling_params(sp: Any, vocab_size: int) -> SamplingParams:
    """Validate a ``sampling_params`` dict into SamplingParams (ProtocolError names the field)."""
    p = "sampling_params."
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise ProtocolError("sampling_params", "expected an object")
    known = set(SamplingParams.__dataclass_fields__) | set(_NEUTRAL_SAMPLING) | _IGNORED_SAMPLING
    for k in sp:
        if k not in known:
            raise ProtocolError(p + k, "unknown sampling parameter")
    for k, neutral in _NEUTRAL_SAMPLING.items():
        if k in sp and sp[k] is not None and sp[k] != neutral:
            raise ProtocolError(p + k, f"not supported by the embedded engine (only {neutral!r})")
    max_new = _num(sp, "max_new_tokens", int, DEFAULT_MAX_NEW_TOKENS, p)
    if max_new < 0:  # 0: score the prompt only (SGLang's prefill-only request)
        raise ProtocolError(p + "max_new_tokens", f"must be >= 0, got {max_new}")
    temperature = _num(sp, "temperature", float, 1.0, p)
    if temperature < 0:
        raise ProtocolError(p + "temperature", f"must be >= 0, got {temperature}")
    top_p = _num(sp, "top_p", float, 1.0, p)
    if not 0 < top_p <= 1:
        raise ProtocolError(p + "top_p", f"must be in (0, 1], got {top_p}")
    top_k = _num(sp, "top_k", int, -1, p)
    if top_k == 0 or top_k < -1:
        raise ProtocolError(p + "top_k", f"must be -1 (disabled) or >= 1, got {top_k}")
    min_p = _num(sp, "min_p", float, 0.0, p)
    if not 0 <= min_p <= 1:
        raise ProtocolError(p + "min_p", f"must be in [0, 1], got {min_p}")
    stop = sp.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise ProtocolError(p + "stop", "expected a non-empty string or a list of them")
    stop_ids = sp.get("stop_token_ids") or []
    if isinstance(stop_ids, int) and not isinstance(stop_ids, bool):
        stop_ids = [stop_ids]
    stop_ids = _int_list(stop_ids, p + "stop_token_ids", vocab_size)
    seed = sp.get("sampling_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ProtocolError(p + "sampling_seed", f"expected an integer, got {seed!r}")
    return SamplingParams(
        max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        stop=tuple(stop), stop_token_ids=tuple(stop_ids),
        ignore_eos=_flag(sp, "ignore_eos", False, p),
        skip_special_tokens=_flag(sp, "skip_special_tokens", True, p),
        spaces_between_special_tokens=_flag(sp, "spaces_between_special_tokens", True, p),
        no_stop_trim=_flag(sp, "no_stop_trim", False, p), sampling_seed=seed)


_KNOWN_TOP = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "return_text_in_logprobs",
              "logprob_start_len", "lora_path"}


def _start_len(v: Any, name: str) -> int:
    """``logprob_start_len``: -1 (SGLang's default: no prompt log-probs) or a prompt position."""
    if v is None:
        return -1
    if isinstance(v, bool) or not isinstance(v, int) or v < -1:
        raise ProtocolError(name, f"expected -1 or a position >= 0, got {v!r}")
    return v


def _check_top_fields(body: Any) -> None:
    if not isinstance(body, dict):
        raise ProtocolError("body", "expected a JSON object")
    for k in body:
        if k in _KNOWN_TOP or k in _IGNORED_TOP:
            continue
        if k in _NEUTRAL_TOP:
            if body[k] not in (None, _NEUTRAL_TOP[k]):
                raise ProtocolError(k, f"not supported by the embedded engine (only {_NEUTRAL_TOP[k]!r})")
            continue
        raise ProtocolError(k, "unknown field")


def _is_batch_ids(ids: Any) -> bool:
    # SGLang's rule: input_ids is one prompt when its first element is an int, else a batch
    return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)


def is_batch(body: Any) -> bool:
    """Whether a ``/generate`` body uses SGLang's batch form (``text`` list or ``input_ids`` list of lists)."""
    return isinstance(body, dict) and (isinstance(body.get("text"), list) or _is_batch_ids(body.get("input_ids")))


def parse_generate(body: Any, vocab_size: int) -> GenerateInput:
    """Validate a single-prompt ``/generate`` JSON body (ProtocolError names the offending field)."""
    _check_top_fields(body)
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ProtocolError("text/input_ids", "give exactly one of text and input_ids")
    if text is not None and not isinstance(text, str):
        raise ProtocolError("text", "expected a string (a batch goes through parse_generate_request)")
    if ids is not None:
        if _is_batch_ids(ids):
            raise ProtocolError("input_ids", "a batch (list of lists) goes through parse_generate_request")
        ids = _int_list(ids, "input_ids", vocab_size)
        if not ids:
            raise ProtocolError("input_ids", "must not be empty")
    rid = body.get("rid")
    if rid is None:
        rid = f"{_RID_PREFIX}{next(_RID_COUNTER)}"
    elif not isinstance(rid, str) or not rid:
        raise ProtocolError("rid", "expected a non-empty string")
    return GenerateInput(
        rid=rid, input_ids=ids, text=text,
        params=parse_sampling_params(body.get("sampling_params"), vocab_size),
        return_logprob=_flag(body, "return_logprob", False, ""),
        return_text_in_logprobs=_flag(body, "return_text_in_logprobs", False, ""),
        logprob_start_len=_start_len(body.get("logprob_start_len"), "logprob_start_len"),
        lora_path=_lora_path(body.get("lora_path"), "lora_path"))


def _lora_path(v: Any, name: str) -> str | None:
    if v is not None and (not isinstance(v, str) or not v):
        raise ProtocolError(name, f"expected the name of a loaded LoRA adapter or null, got {v!r}")
    return v


def _per_element(body: dict, name: str, n: int) -> list[Any]:
    """A field that is either shared (one value, or absent) or a list of one value per element."""
    v = body.get(name)
    if isinstance(v, list):
        if len(v) != n:
            raise ProtocolError(name, f"a list of {len(v)} values for a batch of {n} prompts")
        return v
    return [v] * n


def parse_generate_request(body: Any, vocab_size: int) -> tuple[list[GenerateInput], bool]:
    """Validate a ``/generate`` body, single or batch: returns (elements, is_batch).

    A batch answer is a JSON list with one result per element, in order. Nothing is started
    unless every element is valid: the first bad one raises ProtocolError naming it.
    """
    if not is_batch(body):
        return [parse_generate(body, vocab_size)], False
    _check_top_fields(body)
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ProtocolError("text/input_ids", "give exactly one of text and input_ids")
    name, prompts = ("text", text) if text is not None else ("input_ids", ids)
    if not prompts:
        raise ProtocolError(name, "an empty batch")
    n = len(prompts)
    rid = body.get("rid")
    if rid is None:
        rids = [f"{_RID_PREFIX}{next(_RID_COUNTER)}" for _ in range(n)]
    elif isinstance(rid, str) and rid:
        rids = batch_rids(rid, n)  # SGLang's expansion: per-element aborts use these
    elif isinstance(rid, list):
        if len(rid) != n:
            raise ProtocolError("rid", f"a list of {len(rid)} rids for a batch of {n} prompts")
        rids = rid
    else:
        raise ProtocolError("rid", "expected a non-empty string or a list of them")
    params = _per_element(body, "sampling_params", n)
    logprob = _per_element(body, "return_logprob", n)
    starts = _per_element(body, "logprob_start_len", n)
    loras = _per_element(body, "lora_path", n)
    start_name = "logprob_start_len" + ("[{}]" if isinstance(body.get("logprob_start_len"), list) else "")
    shared_sp = not isinstance(body.get("sampling_params"), list)
    shared: SamplingParams | None = None  # a shared dict is validated once (at the first element)
    seen: set[str] = set()
    out = []
    for i in range(n):
        p = prompts[i]
        if name == "text":
            if not isinstance(p, str):
                raise ProtocolError(f"text[{i}]", "expected a string")
        else:
            p = _int_list(p, f"input_ids[{i}]", vocab_size)
            if not p:
                raise ProtocolError(f"input_ids[{i}]", "must not be empty")
        r = rids[i]
        if not isinstance(r, str) or not r:
            raise ProtocolError(f"rid[{i}]", "expected a non-empty string")
        if r in seen:
            raise ProtocolError(f"rid[{i}]", f"{r!r} appears twice in the batch")
        seen.add(r)
        try:
            if shared_sp:
                shared = sp = shared or parse_sampling_params(params[i], vocab_size)
            else:
                sp = parse_sampling_params(params[i], vocab_size)
        except ProtocolError as e:
            if shared_sp:
                raise
            # name the element: sampling_params[1].top_p
            field_name = e.field.replace("sampling_params", f"sampling_params[{i}]", 1)
            raise ProtocolError(field_name, str(e)[len(e.field) + 2:]) from None
        lp_name = "return_logprob" if not isinstance(body.get("return_logprob"), list) else f"return_logprob[{i}]"
        lp = logprob[i]
        if lp is not None and not isinstance(lp, bool):
            raise ProtocolError(lp_name, f"expected a boolean, got {lp!r}")
        out.append(GenerateInput(
            rid=r, input_ids=p if name == "input_ids" else None, text=p if name == "text" else None,
            params=sp, return_logprob=bool(lp),
            return_text_in_logprobs=_flag(body, "return_text_in_logprobs", False, ""),
            logprob_start_len=_start_len(starts[i], start_name.format(i)),
            lora_path=_lora_path(loras[i], f"lora_path[{i}]" if isinstance(body.get("lora_path"), list)
                                 else "lora_path")))
    return out, True
