"""The token-in-token-out validator: do a sample's ids, loss mask and turns hold what the engine saw
and produced, and what the chat template would render?

Every engine answer appended to a sample leaves a record in ``sample.metadata["engine_spans"]``:
``[start, end, prompt_tokens, weight_version, prefix_crc, output_crc]`` (the default generate writes
them; a custom generate's ``/generate`` calls are recorded through ``plugin_api.note_engine_call``,
which slime's ``post()`` calls, and mapped onto the sample when it returns). A generate that adds
environment turns with ``plugins.chat_append`` logs them in ``sample.metadata["chat_turns"]``:
``[start, end, messages]`` (``log_chat_turn``). Both ride along into the buffer and Parquet files.

**Hard errors** (``HARD``) mean the ids trained on are not what the engine saw or produced:
``prompt_mismatch`` (the engine's reported ``prompt_tokens`` differ from the ids held when it was
called), ``not_append_only`` (the ids before an engine call, or its output, changed afterwards),
``mask_outside_engine`` (loss mask 1 on a token no engine produced), ``mask_inside_engine`` (loss
mask 0 inside an engine output; allowed for a whole output of an older policy, which
``--mask-offpolicy-in-partial-rollout`` masks, and for ``remove_sample``).

**Soft differences** (``SOFT``) from the chat template's render of the same conversation: the
ids are faithful, but not what the template would write: ``missing_close`` (a model turn without
the template's close token before the next turn), ``boundary_merge`` (the same text split into
other tokens: the model's own tokenization, or tokens that would merge across a join),
``whitespace``, ``history_rewrite`` (the template renders earlier turns differently once later ones
exist, e.g. it drops an earlier ``<think>``) and ``template_mismatch`` (anything else). Soft checks
need the tokenizer and a turn log (a sample with one engine output needs none); a prompt given as
templated text is replaced by ``chat_append.PROMPT_STANDIN`` and only the turns after it compared.

``--tito-check warn`` counts and logs both kinds (``rollout/tito/<kind>``); ``fail`` also fails a
sample with a hard error (reason ``tito: <kind>``, counted like every failure). A sample without
engine records (a custom generate that calls the engines by other means) is counted as
``tito/unrecorded``. Over a saved Parquet of groups::

    python -m rollout_manager.tito out.parquet [--hf-checkpoint DIR]
"""

from __future__ import annotations

import argparse
import difflib
import logging
import random
import sys
import zlib
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from buffer.sample import Sample, Status, parse_weight_version
from plugins.chat_append import (PROMPT_STANDIN, ChatAppendError, check_append_stable, close_remainder, render_ids,
                                 render_text, template_close, tokenizer_name)
from rollout_manager.rewards import mark_failed
from rollout_manager.settings import TITO_MODES, RolloutSettings

__all__ = ["HARD", "SOFT", "TITO_MODES", "TitoReport", "TitoChecker", "token_crc", "record_engine_span",
           "spans_from_calls", "log_chat_turn", "check_sample", "tito_checker", "main"]

log = logging.getLogger(__name__)
HARD = ("prompt_mismatch", "not_append_only", "mask_outside_engine", "mask_inside_engine")
SOFT = ("missing_close", "boundary_merge", "whitespace", "history_rewrite", "template_mismatch")
ENGINE_SPANS, CHAT_TURNS = "engine_spans", "chat_turns"


def token_crc(ids: Iterable[int]) -> int:
    """A checksum of token ids (what a span record keeps of the ids around it)."""
    return zlib.crc32(array("q", ids).tobytes())


def record_engine_span(sample: Sample, start: int, output_ids: list[int], meta: dict) -> None:
    """Record one engine answer appended at ``sample.tokens[start:]`` (call it once the output is
    appended; ``meta``: the answer's ``meta_info``)."""
    end = start + len(output_ids)
    prompt_tokens = meta.get("prompt_tokens")
    version = parse_weight_version(meta.get("weight_version"))
    sample.metadata.setdefault(ENGINE_SPANS, []).append(
        [start, end, prompt_tokens, version, token_crc(sample.tokens[:start]), token_crc(output_ids)])


def spans_from_calls(sample: Sample, calls: list[tuple[tuple[int, ...], list[int], dict]]) -> None:
    """Add the ``/generate`` calls a custom generate made for ``sample`` (``(input_ids, output_ids,
    meta_info)``, from ``plugin_api.recording_engine_calls``) to its engine spans."""
    spans = sample.metadata.setdefault(ENGINE_SPANS, [])
    known = {(s[0], s[1]) for s in spans}
    for input_ids, output_ids, meta in calls:
        start = len(input_ids)
        if (start, start + len(output_ids)) in known:
            continue  # the default generate, called inside the custom one, recorded it already
        spans.append([start, start + len(output_ids), meta.get("prompt_tokens"),
                      parse_weight_version(meta.get("weight_version")), token_crc(input_ids), token_crc(output_ids)])
    spans.sort(key=lambda s: (s[0], s[1]))


def log_chat_turn(sample: Sample, start: int, messages: list[dict]) -> None:
    """Log environment turns appended at ``sample.tokens[start:]`` (call it once they are appended):
    the soft checks render them with the template."""
    sample.metadata.setdefault(CHAT_TURNS, []).append([start, len(sample.tokens), [dict(m) for m in messages]])


@dataclass
class TitoReport:
    """What ``check_sample`` found: hard and soft kinds (each kind once), and whether each check ran."""

    hard: list[str] = field(default_factory=list)
    soft: list[str] = field(default_factory=list)
    recorded: bool = True  # the sample carries engine records (hard checks ran)
    soft_checked: bool = False
    detail: str = ""  # the first finding, for the log

    def add(self, kind: str, detail: str) -> None:
        kinds = self.hard if kind in HARD else self.soft
        if kind not in kinds:
            kinds.append(kind)
        self.detail = self.detail or f"{kind}: {detail}"


def check_sample(sample: Sample, tokenizer: Any = None, tools: list[dict] | None = None) -> TitoReport:
    """Check one sample (see the module doc); soft checks only with a ``tokenizer`` that has a chat
    template."""
    report = TitoReport()
    spans = sample.metadata.get(ENGINE_SPANS) or []
    if not spans:
        report.recorded = False
    else:
        _check_hard(sample, spans, report)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None) and spans:
        _check_soft(sample, spans, tokenizer, tools, report)
    return report


def _check_hard(sample: Sample, spans: list[list], report: TitoReport) -> None:
    tokens, n = sample.tokens, len(sample.tokens)
    prompt_len = sample.prompt_length
    engine = bytearray(n)  # 1 where an engine produced the token
    prev_end = 0
    for start, end, prompt_tokens, _version, in_crc, out_crc in spans:
        if not 0 <= start <= end <= n or start < prev_end:
            report.add("not_append_only", f"engine output [{start}, {end}) lies outside or before what was held")
            continue
        prev_end = end
        if prompt_tokens is not None and prompt_tokens != start:
            report.add("prompt_mismatch", f"the engine saw {prompt_tokens} prompt tokens, {start} were held")
        if token_crc(tokens[:start]) != in_crc:
            report.add("not_append_only", f"the {start} tokens before an engine call changed afterwards")
        if token_crc(tokens[start:end]) != out_crc:
            report.add("not_append_only", f"engine output [{start}, {end}) is not kept as the engine gave it")
        engine[start:end] = b"\x01" * (end - start)
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
    newest = max((s[3] for s in spans), default=0)
    masked_whole = set()  # positions of whole outputs of an older policy with mask 0 (off-policy masking)
    for start, end, _p, version, *_ in spans:
        if version < newest and start >= prompt_len and end <= n and not any(mask[start - prompt_len:end - prompt_len]):
            masked_whole.update(range(start, end))
    for i, m in enumerate(mask):
        p = prompt_len + i
        if p >= n:
            break
        if m and not engine[p]:
            report.add("mask_outside_engine", f"loss mask 1 at token {p}, which no engine produced")
        elif not m and engine[p] and not sample.remove_sample and p not in masked_whole:
            report.add("mask_inside_engine", f"loss mask 0 at token {p}, inside an engine output")


def _model_content(tokenizer: Any, ids: list[int], close: list[int]) -> str:
    """A model turn's text as a message content: its ids without the close they end with."""
    cut = len(ids) - (len(close) - len(close_remainder(ids, close))) if close else len(ids)
    return tokenizer.decode(ids[:cut])


def _check_soft(sample: Sample, spans: list[list], tokenizer: Any, tools: list[dict] | None,
                report: TitoReport) -> None:
    tokens, prompt_len = sample.tokens, sample.prompt_length
    turns = [(s, e, msgs) for s, e, msgs in sample.metadata.get(CHAT_TURNS) or []]
    model: list[tuple[int, int]] = []
    for s in sorted(x for x in spans if x[1] > x[0] and x[0] >= prompt_len):
        if model and model[-1][1] == s[0]:  # answers back to back are one model turn: a partial rollout's
            model[-1] = (model[-1][0], s[1])  # resume, or the agent loop generating on after a stop string
        else:
            model.append((s[0], s[1]))
    if not model:
        return
    # turn log: every response token must belong to a model output or a logged environment turn
    parts = sorted([(s, e, None) for s, e in model] + turns, key=lambda t: t[0])
    at = prompt_len
    for s, e, _ in parts:
        if s != at:
            return  # untracked tokens (an environment written without a turn log): no render to compare to
        at = e
    if at != len(tokens):
        return
    try:
        close = template_close(tokenizer, tools=tools)
        messages: list[dict] = []
        bounds: list[int] = []  # message counts at each turn boundary (history_rewrite)
        for s, e, msgs in parts:
            if msgs is None:
                messages.append({"role": "assistant", "content": _model_content(tokenizer, tokens[s:e], close)})
            else:
                messages += msgs
            bounds.append(len(messages))
        known = isinstance(sample.prompt, list) and sample.prompt
        head = list(sample.prompt) if known else list(PROMPT_STANDIN)
        conv = head + messages
        gen = conv[-1]["role"] != "assistant"
        whole_text = render_text(tokenizer, conv, add_generation_prompt=gen, tools=tools)
        for k in bounds[:-1]:
            if not whole_text.startswith(render_text(tokenizer, head + messages[:k], add_generation_prompt=False,
                                                     tools=tools)):
                report.add("history_rewrite", "the template renders earlier turns differently once later ones follow")
                break
        rendered = render_ids(tokenizer, conv, add_generation_prompt=gen, tools=tools)
        held = list(tokens)
        if not known:  # compare what follows the prompt only
            prompt = render_ids(tokenizer, head, add_generation_prompt=True, tools=tools)
            rendered, held = rendered[len(prompt):], held[prompt_len:]
    except (ChatAppendError, Exception) as e:  # noqa: BLE001 - a template that cannot render this conversation
        report.add("template_mismatch", f"the template cannot render the sample's conversation: {type(e).__name__}")
        report.soft_checked = True
        return
    report.soft_checked = True
    if not gen and close:  # the close after the final turn is never generated nor needed
        if rendered[len(rendered) - len(close):] == close:
            rendered = rendered[:len(rendered) - len(close)]
        held = held[:len(held) - (len(close) - len(close_remainder(held, close)))]
    _classify(tokenizer, held, rendered, close, report)


def _classify(tokenizer: Any, held: list[int], rendered: list[int], close: list[int], report: TitoReport) -> None:
    if held == rendered:
        return
    specials = set(getattr(tokenizer, "all_special_ids", ()) or ())
    close_special = [t for t in close if t in specials] or close[:1]
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, held, rendered, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        h, r = held[i1:i2], rendered[j1:j2]
        ht, rt = tokenizer.decode(h), tokenizer.decode(r)
        where = f"at token {i1}: held {ht!r}, template {rt!r}"
        if ht == rt:
            report.add("boundary_merge", where)
        elif any(r.count(t) > h.count(t) for t in close_special):
            report.add("missing_close", where)
        elif "".join(ht.split()) == "".join(rt.split()):
            report.add("whitespace", where)
        else:
            report.add("template_mismatch", where)


class TitoChecker:
    """``--tito-check`` applied to samples as they finish: a ``fraction`` of them is checked; in
    ``fail`` mode a hard error fails the sample (reason ``tito: <kind>``). Counts go to
    ``counts`` (the step's ``RolloutStats.tito``) as ``checked``, ``unrecorded``, ``<kind>``."""

    def __init__(self, mode: str, fraction: float = 1.0, tokenizer: Any = None, seed: int = 0):
        if mode not in TITO_MODES:
            raise ValueError(f"--tito-check {mode!r}: choose one of {list(TITO_MODES)}")
        self.mode, self.fraction, self.tokenizer = mode, fraction, tokenizer
        self._rng = random.Random(seed)

    def wants(self, sample: Sample) -> bool:
        """Whether ``sample`` is checked: it finished as trainable and was drawn (``fraction``)."""
        if self.mode == "off" or sample.status not in (Status.COMPLETED, Status.TRUNCATED):
            return False
        return self.fraction >= 1.0 or self._rng.random() < self.fraction

    def check(self, sample: Sample) -> TitoReport:
        """``check_sample`` with this checker's tokenizer (renders templates: the rollout runs it in a
        thread, off the event loop)."""
        return check_sample(sample, self.tokenizer, tools=sample.metadata.get("tools"))

    def settle(self, sample: Sample, report: TitoReport, counts: Counter) -> None:
        """Count and log ``report``; in ``fail`` mode a hard error fails ``sample``."""
        counts["checked"] += 1
        if not report.recorded:
            counts["unrecorded"] += 1
        found = report.hard + report.soft
        for kind in found:
            counts[kind] += 1
        if found:
            more = f" (and {', '.join(found[1:])})" if len(found) > 1 else ""
            log.warning("tito: sample %s (group %s): %s%s", sample.index, sample.group_index, report.detail, more)
        if report.hard and self.mode == "fail":
            mark_failed(sample, f"tito: {report.hard[0]}")

    def apply(self, sample: Sample, counts: Counter) -> TitoReport | None:
        """``wants``, ``check`` and ``settle`` in one call; None when the sample was not checked."""
        if not self.wants(sample):
            return None
        report = self.check(sample)
        self.settle(sample, report, counts)
        return report


def tito_checker(settings: RolloutSettings, tokenizer: Any) -> TitoChecker | None:
    """The run's checker (None with ``--tito-check off``). Probes the tokenizer's chat template
    first (``chat_append.check_append_stable``): an unstable one is refused under ``fail``
    (``ValueError`` naming the flag and the tokenizer) and warned about under ``warn``."""
    s = settings.sampling
    if s.tito_check == "off":
        return None
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        try:
            check_append_stable(tokenizer)
        except ChatAppendError as e:
            if s.tito_check == "fail":
                raise ValueError(f"--tito-check fail: {e}") from None
            log.warning("--tito-check warn: %s (its samples will show soft differences)", e)
    return TitoChecker(s.tito_check, s.tito_check_fraction, tokenizer, seed=settings.seed)


def main(argv: list[str] | None = None) -> int:
    """``python -m rollout_manager.tito FILE.parquet [--hf-checkpoint DIR]``: check every sample of a
    saved Parquet of groups; prints the counts; exit status 1 when a hard error was found."""
    ap = argparse.ArgumentParser(prog="python -m rollout_manager.tito", description=__doc__.split("\n\n")[0])
    ap.add_argument("parquet", help="a Parquet file of groups (python -m rollout_manager --output, the buffer's dumps)")
    ap.add_argument("--hf-checkpoint", default=None, help="the model whose tokenizer's chat template the soft checks "
                    "render (default: hard checks only)")
    args = ap.parse_args(argv)
    from buffer.arrow import read_parquet  # noqa: PLC0415 - pyarrow only for the CLI

    try:
        groups = read_parquet(args.parquet)
    except (OSError, ValueError) as e:
        print(f"{args.parquet}: cannot read it as a Parquet of groups: {e}", file=sys.stderr)
        return 2
    tokenizer = None
    if args.hf_checkpoint:
        from rollout_manager.tokenizer import load_tokenizer  # noqa: PLC0415

        tokenizer = load_tokenizer(args.hf_checkpoint)
    checker, counts = TitoChecker("warn", 1.0, tokenizer), Counter()
    total = 0
    for group in groups:
        for sample in group:
            total += 1
            checker.apply(sample, counts)
    name = f" (template of {tokenizer_name(tokenizer)})" if tokenizer is not None else " (hard checks only)"
    print(f"{args.parquet}: {total} samples, {counts['checked']} checked{name}")
    for kind in ("unrecorded", *HARD, *SOFT):
        if counts[kind]:
            print(f"  {kind:<22}{counts[kind]:>8}  {'hard' if kind in HARD else ''}")
    return 1 if any(counts[k] for k in HARD) else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    sys.exit(main())
