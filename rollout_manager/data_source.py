"""Prompt data: load jsonl/Parquet prompts, validate them line by line, and serve groups.

``load_prompts`` reads a file into ``PromptRecord``s (prompt token ids computed once, with the
tokenizer's chat template when asked; the record's ``prompt``, and so ``Sample.prompt``, is then
the templated text the ids encode, as in slime). A bad line (not UTF-8, malformed JSON, a missing key, an
empty prompt, a prompt over ``--rollout-max-prompt-len``) is reported with its line number and
reason, skipped and counted; with ``--strict-data`` it is a ``ValueError`` instead.

``DataSource`` serves groups in slime's terms: ``get_samples(n)`` returns ``n`` groups of
``n_samples_per_prompt`` fresh Samples, ``add_samples(groups)`` takes unfinished groups back (they
are served first). Its position (epoch, offset, groups given back) is in ``state_dict`` so a
resumed run continues where it stopped.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from buffer.sample import Sample, Status
from rollout_manager.plugin_api import current_context, current_step
from rollout_manager.settings import DataSettings

log = logging.getLogger(__name__)


@dataclass
class PromptRecord:
    """One validated prompt: its text (templated with ``--apply-chat-template``, else as given), its
    label, metadata and token ids."""

    prompt: str | list[dict[str, Any]]
    label: Any
    metadata: dict[str, Any]
    input_ids: list[int]


@dataclass
class DataReport:
    """What loading a prompt file skipped: ``(line number, reason)`` pairs and counts by reason."""

    path: str
    loaded: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)

    @property
    def skipped_by_reason(self) -> dict[str, int]:
        return dict(Counter(reason.split(":")[0] for _, reason in self.skipped))


def _read_rows(path: Path) -> list[tuple[int, Any]]:
    """(line/row number, decoded row or an Exception describing why it is bad)."""
    rows: list[tuple[int, Any]] = []
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            rows.append((i, row))
        return rows
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"--prompt-data {str(path)!r}: expected a .jsonl or .parquet file")
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                rows.append((i, ValueError(f"not UTF-8: byte {e.start}")))
                continue
            if not text.strip():
                continue  # blank lines (a trailing newline) are not data
            try:
                rows.append((i, json.loads(text)))
            except json.JSONDecodeError as e:
                rows.append((i, ValueError(f"malformed JSON: {e.msg} at column {e.colno}")))
    return rows


def _prompt_text(prompt: Any, settings: DataSettings, tokenizer: Any) -> str:
    if settings.apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not isinstance(prompt, str):
        raise ValueError("prompt is a message list: pass --apply-chat-template")
    return prompt


def _record(row: Any, settings: DataSettings, label_required: bool = True) -> tuple[Any, Any, dict]:
    if isinstance(row, Exception):
        raise row
    if not isinstance(row, dict):
        raise ValueError(f"not a JSON object: {type(row).__name__}")
    if settings.input_key not in row:
        raise ValueError(f"missing key: {settings.input_key!r} (--input-key)")
    prompt = row[settings.input_key]
    if not isinstance(prompt, (str, list)) or not prompt or (isinstance(prompt, str) and not prompt.strip()):
        raise ValueError(f"empty prompt: {settings.input_key!r} is {prompt!r}")
    if isinstance(prompt, list) and not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise ValueError("bad messages: a list prompt must hold {role, content} objects")
    label = None
    if settings.label_key:
        if settings.label_key not in row and label_required:
            raise ValueError(f"missing key: {settings.label_key!r} (--label-key)")
        label = row.get(settings.label_key)
    metadata = row.get(settings.metadata_key) if settings.metadata_key else None
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        raise ValueError(f"bad metadata: {settings.metadata_key!r} must be an object, got {type(metadata).__name__}")
    return prompt, label, metadata


def load_prompts(path: str | Path, settings: DataSettings, tokenizer: Any, flag: str = "--prompt-data",
                 conversations: Callable[[Any, dict], list[int]] | None = None
                 ) -> tuple[list[PromptRecord], DataReport]:
    """Read and validate a prompt file. Bad lines are skipped and reported (or raise with --strict-data).

    ``conversations``: the rows are whole conversations (the SFT rollout, ``rollout_manager/sft.py``):
    each record keeps its messages as its prompt, with the ids ``conversations(messages, metadata)``
    gives (a ``ValueError`` from it skips the row like any bad line)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{flag} {str(path)!r}: no such file")
    report = DataReport(str(path))
    records: list[PromptRecord] = []
    parsed: list[tuple[int, Any, Any, dict, str]] = []
    for line, row in _read_rows(path):
        try:
            prompt, label, metadata = _record(row, settings, label_required=conversations is None)  # SFT: no label
            if conversations is not None:
                records.append(PromptRecord(prompt, label, metadata, list(conversations(prompt, metadata))))
                continue
            parsed.append((line, prompt, label, metadata, _prompt_text(prompt, settings, tokenizer)))
        except (ValueError, TypeError) as e:
            _skip(report, settings, flag, line, str(e))
    # One batched call: fast tokenizers encode thousands of prompts in milliseconds.
    ids = tokenizer([p[4] for p in parsed], add_special_tokens=False)["input_ids"] if parsed else []
    for (line, prompt, label, metadata, text), input_ids in zip(parsed, ids):
        if settings.rollout_max_prompt_len is not None and len(input_ids) > settings.rollout_max_prompt_len:
            _skip(report, settings, flag, line, f"prompt too long: {len(input_ids)} tokens > "
                  f"--rollout-max-prompt-len {settings.rollout_max_prompt_len}")
            continue
        # the samples carry the text the ids encode: the templated text with --apply-chat-template (slime's)
        records.append(PromptRecord(text if settings.apply_chat_template else prompt, label, metadata,
                                    list(input_ids)))
    report.loaded = len(records)
    if report.skipped:
        log.warning("%s: skipped %d bad line(s): %s", path, len(report.skipped), report.skipped_by_reason)
    if not records:
        raise ValueError(f"{flag} {str(path)!r}: no usable prompts ({len(report.skipped)} bad lines: "
                         f"{report.skipped_by_reason}; first: line {report.skipped[0][0]}: {report.skipped[0][1]})"
                         if report.skipped else f"{flag} {str(path)!r}: no prompts")
    return records, report


def _skip(report: DataReport, settings: DataSettings, flag: str, line: int, reason: str) -> None:
    if settings.strict_data:
        raise ValueError(f"{flag} {report.path!r} line {line}: {reason} (--strict-data)")
    log.warning("%s line %d: %s; skipped", report.path, line, reason)
    report.skipped.append((line, reason))


class DataSource:
    """Serves groups of fresh Samples over epochs of (optionally shuffled) prompts, resumably."""

    def __init__(self, records: list[PromptRecord], n_samples_per_prompt: int, shuffle: bool = False,
                 seed: int = 0, num_epoch: int | None = None):
        if not records:
            raise ValueError("DataSource: no prompts")
        self.records = records
        self.n_samples_per_prompt = n_samples_per_prompt
        self.shuffle, self.seed, self.num_epoch = shuffle, seed, num_epoch
        self.epoch, self.offset, self.next_group_index = 0, 0, 0
        self._returned: deque[list[Sample]] = deque()
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:  # a fresh permutation per epoch, reproducible from (seed, epoch)
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    @property
    def exhausted(self) -> bool:
        """No returned groups left and every epoch served."""
        return not self._returned and self.num_epoch is not None and self.epoch >= self.num_epoch

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """Up to ``num_samples`` groups: given-back groups first, then new prompts (fewer at the end)."""
        groups: list[list[Sample]] = []
        while len(groups) < num_samples and self._returned:
            groups.append(self._returned.popleft())
        while len(groups) < num_samples and not self.exhausted:
            rec = self.records[self._order[self.offset]]
            groups.append(self._new_group(rec))
            self.offset += 1
            if self.offset == len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
        return groups

    def _new_group(self, rec: PromptRecord) -> list[Sample]:
        gi = self.next_group_index
        self.next_group_index += 1
        n = self.n_samples_per_prompt
        return [Sample(group_index=gi, index=gi * n + i, prompt=rec.prompt, label=rec.label,
                       metadata=dict(rec.metadata), tokens=list(rec.input_ids), response_length=0,
                       loss_mask=[], rollout_log_probs=[], status=Status.PENDING) for i in range(n)]

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Give groups back (unfinished or aborted); they are served before any new prompt."""
        for g in groups:
            if not g:
                raise ValueError("add_samples: empty group")
            self._returned.append(g)

    @property
    def num_returned(self) -> int:
        return len(self._returned)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "next_group_index": self.next_group_index,
                "num_prompts": len(self.records), "seed": self.seed, "shuffle": self.shuffle,
                "returned": [[s.to_dict() for s in g] for g in self._returned]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_prompts"] != len(self.records) or state["shuffle"] != self.shuffle or state["seed"] != self.seed:
            raise RuntimeError(f"data source state is for {state['num_prompts']} prompts (shuffle={state['shuffle']}, "
                               f"seed={state['seed']}); this one has {len(self.records)} (shuffle={self.shuffle}, "
                               f"seed={self.seed})")
        self.epoch, self.offset = state["epoch"], state["offset"]
        self.next_group_index = state["next_group_index"]
        self._order = self._epoch_order(self.epoch)
        self._returned = deque([[Sample.from_dict(d) for d in g] for g in state["returned"]])


def _group_key(group: list[Sample]) -> Any:
    """A group's identity across the copies a generate may make: its ``group_index`` (unique per
    drawn prompt in our sources), else its first sample object's."""
    for s in group:
        if s.group_index is not None:
            return ("group", s.group_index)
    return ("object", id(group[0])) if group else None


class ThreadSafeDataSource:
    """The data source as the manager and its rollout functions use it: every call is serialized
    by one lock, so a plugin's own thread (slime's fully_async worker) may draw groups while the
    manager checkpoints it or gives groups back.

    Groups drawn outside a rollout step (from a plugin's own thread or loop, or detached work)
    are *held by a plugin* until they come back: in a rollout function's output (``settle``) or
    through ``add_samples``. ``held_groups()`` gives copies of them, reset to their prompts, for a
    checkpoint: a resumed run serves them again first, so each prompt is trained once even though
    the worker drew it before the checkpoint. Anything else (``state_dict``, ``exhausted``, a
    slime data source's own methods) is the wrapped source's, called under the lock."""

    def __init__(self, source: Any):
        self._source = source
        self._lock = threading.RLock()
        self._held: dict[Any, list[Sample]] = {}

    @property
    def source(self) -> Any:
        """The wrapped data source."""
        return self._source

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """The source's ``get_samples``; outside a rollout step the groups are noted as held."""
        with self._lock:
            groups = self._source.get_samples(num_samples)
            if _outside_a_step():
                for g in groups:
                    if g:
                        self._held[_group_key(g)] = g
            return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """The source's ``add_samples``; the groups are no longer held."""
        with self._lock:
            self._source.add_samples(groups)
            self._forget(groups)

    def settle(self, groups: list[list[Sample]]) -> None:
        """A rollout function returned these groups: they are no longer held."""
        with self._lock:
            self._forget(groups)

    def _forget(self, groups: list[list[Sample]]) -> None:
        for g in groups or []:
            if isinstance(g, list) and g:
                flat = [x for part in g for x in (part if isinstance(part, list) else [part])]
                self._held.pop(_group_key(flat), None)

    def held_groups(self) -> list[list[Sample]]:
        """Copies of the groups held by a plugin, reset to their prompts (for a checkpoint)."""
        from rollout_manager.generate import reset_sample

        with self._lock:
            held = [[Sample.from_dict(s.to_dict()) for s in g] for g in self._held.values()]
        for g in held:
            for s in g:
                reset_sample(s)
        return held

    @property
    def num_held(self) -> int:
        """How many groups a plugin holds now."""
        return len(self._held)

    def forget_held(self) -> None:
        """A resumed run: what was held belongs to the previous run."""
        with self._lock:
            self._held.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._source)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        with self._lock:
            value = getattr(self._source, name)
        if not callable(value):
            return value

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return value(*args, **kwargs)
        return locked


def _outside_a_step() -> bool:
    """Whether the caller draws outside a rollout step: a plugin's own thread or loop, or work
    handed over from one (the manager's detached step)."""
    ctx, step = current_context(None), current_step(None)
    return step is None or (ctx is not None and ctx.detached is not None and step is ctx.detached.step)
