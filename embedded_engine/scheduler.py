"""Continuous batching: one scheduler loop in a dedicated thread.

Each iteration: run queued control commands (weight updates, checksums; so they happen
between forwards, never inside one), apply aborts, admit waiting requests (one batched prefill
whose rows then join the running batch), then one batched decode step for every running row.
Finished rows leave the batch lazily: they are compacted away when they are a quarter of it or
when new rows join (both copy the cache, so it is done at most once per join).

Results go back through ``Request.on_finish``, called from this thread; the server's callback
hands them to its event loop with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .model_runner import Batch, ModelRunner
from .protocol import SamplingParams
from .sampling import RowParams, build_row_params, sample

log = logging.getLogger(__name__)


@dataclass
class Request:
    """One generation request as the scheduler sees it."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    on_finish: Callable[["Request"], None]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict | None = None
    error: BaseException | None = None
    weight_version: str = ""
    generator: torch.Generator | None = None
    max_tokens: int = 0  # max_new_tokens capped by the context length
    stop_ids: frozenset[int] = frozenset()
    arrival: float = field(default_factory=time.monotonic)
    lora: int | None = None  # the LoRA adapter it runs with (embedded_engine/lora.py's uid; None: the base)


class Scheduler:
    """Owns the running batch and the loop thread. All public methods are thread-safe."""

    def __init__(self, runner: ModelRunner, max_running_requests: int, max_prefill_tokens: int,
                 random_seed: int | None, weight_version: str):
        self.runner = runner
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = weight_version
        self._shared_gen = torch.Generator(runner.device).manual_seed(
            random_seed if random_seed is not None else random.randrange(2**63))
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._live: dict[str, Request] = {}  # rid -> waiting or running request
        self._aborts: list[tuple[str | None, str]] = []  # (rid or None for all, message)
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._paused = False
        self._kept = False  # the last pause kept its requests (in_place, retract)
        self._stopping = False
        self._busy = False  # the scheduler thread is running commands or a step (under _cv)
        self._inline = False  # a command runs in the caller's thread (run_now_if_paused): hold off
        # running batch state (scheduler thread only)
        self._batch: Batch | None = None
        self._rows: list[Request | None] = []  # batch row -> request (None: finished, awaiting compaction)
        self._alive_idx = torch.zeros(0, dtype=torch.long)
        self._row_params: RowParams | None = None
        self._n_running = 0
        self._n_tokens = 0  # prompt + output tokens of the running rows (at the last batch change)
        self.steps = 0  # decode steps run
        self.prefills = 0  # prefill forwards run
        self.finished = 0  # requests finished (any reason)
        # LoRA (embedded_engine/lora.py): switch(uid) makes the weights hold that adapter; running rows
        # all share the adapter merged in, and it changes only when none is running
        self.lora_switch: Callable[[int | None], None] | None = None
        self.lora_merged: int | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()

    # --- API (any thread) -------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue a request. RuntimeError if its rid is already in flight or the engine stopped."""
        p = req.params
        if p.sampling_seed is not None:
            req.generator = torch.Generator(self.runner.device).manual_seed(p.sampling_seed)
        req.max_tokens = min(p.max_new_tokens, self.runner.context_length - len(req.prompt_ids))
        req.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.runner.eos_ids)
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            if req.rid in self._live:
                raise RuntimeError(f"rid {req.rid!r} is already in flight")
            self._live[req.rid] = req
            self._waiting.append(req)
            self._cv.notify()

    def abort(self, rid: str | None, message: str = "aborted by request") -> None:
        """Abort one request (``rid``) or all (``None``); each returns with finish_reason abort."""
        with self._cv:
            self._abort_locked(rid, message)
            self._cv.notify()

    def pause(self, mode: str) -> bool:
        """SGLang's pause modes: ``abort`` aborts everything in flight; ``in_place`` and
        ``retract`` keep requests (and their KV cache) and stop stepping until ``resume``.

        Returns True when the engine is already quiet (no step running, no abort pending): the
        caller need not wait for a step to end (``run_command``), which saves a thread hop.
        """
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"mode {mode!r}: expected abort, in_place or retract")
        with self._cv:
            if mode == "abort":
                self._abort_locked(None, "aborted by pause_generation")
            self._kept = mode != "abort"  # requests the pause keeps: a cache flush cannot run under them
            self._paused = True
            self._cv.notify()
            return not self._busy and not self._aborts

    def _abort_locked(self, rid: str | None, message: str) -> None:
        for req in list(self._waiting):
            if rid is None or req.rid == rid:
                self._waiting.remove(req)
                self._finish(req, {"type": "abort", "message": message})
        # Running rows are the scheduler thread's: it aborts them. With no step running and no
        # running row, an abort-all has nothing left to do there.
        if rid is not None or self._busy or self._n_running:
            self._aborts.append((rid, message))

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify()

    @property
    def paused(self) -> bool:
        return self._paused

    def run_command(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` in the scheduler thread between two forwards (also while paused)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            self._commands.append((fn, fut))
            self._cv.notify()
        return fut

    def run_now_if_paused(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` in the calling thread when generation is paused and the scheduler thread is
        idle with nothing queued (no forward can run meanwhile, and ``fn`` keeps its place in
        line); otherwise queue it like ``run_command``. Returns a future of its result.

        For a weight push on a GPU: the copy of a version's last bucket only queues GPU work,
        and the answer waits for it; a hop to the scheduler thread and back costs more.
        """
        with self._cv:
            inline = self._paused and not self._busy and not self._commands and not self._aborts \
                and not self._stopping and not self._inline
            if inline:
                self._inline = True
        if not inline:
            return self.run_command(fn)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            fut.set_result(fn())
        except BaseException as e:  # delivered to the caller, as run_command does
            fut.set_exception(e)
        finally:
            with self._cv:
                self._inline = False
                self._cv.notify()
        return fut

    def holds_paused_requests(self) -> bool:
        """Paused by ``in_place`` or ``retract`` with requests kept (SGLang cannot flush its cache then)."""
        with self._cv:
            return self._paused and self._kept and bool(self._live)

    def load(self) -> dict:
        with self._cv:
            return {"num_running_reqs": self._n_running, "num_waiting_reqs": len(self._waiting),
                    "num_reqs": len(self._live), "num_tokens": self._n_tokens}

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    # --- the loop (scheduler thread) --------------------------------------------------------
    def _has_work(self) -> bool:
        if self._inline:  # woken while a command runs in another thread: wait for its notify
            return False
        return bool(self._commands or self._aborts or
                    (not self._paused and (self._waiting or self._n_running)))

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._busy = False
                while not self._stopping and not self._has_work():
                    self._cv.wait()
                if self._stopping:
                    break
                self._busy = True
                commands, self._commands = self._commands, []
                aborts, self._aborts = self._aborts, []
                admit = [] if self._paused else self._take_admissible()
                step = not self._paused
            for fn, fut in commands:
                try:
                    fut.set_result(fn())
                except BaseException as e:  # delivered to the caller, who reports it
                    fut.set_exception(e)
            if admit and admit[0].lora != self.lora_merged and self.lora_switch is not None:
                try:  # no row is running (_take_admissible): the weights may change under none
                    self.lora_switch(admit[0].lora)
                    self.lora_merged = admit[0].lora
                except Exception as e:
                    for req in admit:
                        self._finish(req, None, error=e)
                    admit = []
            try:
                with torch.inference_mode():
                    self._apply_aborts(aborts)
                    if step:
                        self._step(admit)
            except Exception as e:
                log.exception("scheduler step failed; failing the running requests")
                self._fail_all(e, admit)
        self._fail_all(RuntimeError("the engine stopped"), [])

    def _take_admissible(self) -> list[Request]:
        room = self.max_running - self._n_running
        admit: list[Request] = []
        longest = 0
        if self.lora_switch is not None and self._waiting:
            return self._take_lora_admissible(room)
        while self._waiting and len(admit) < room:
            n = len(self._waiting[0].prompt_ids)
            # the prefill is padded to its longest prompt: bound the padded token count
            if admit and (len(admit) + 1) * max(longest, n) > self.max_prefill_tokens:
                break
            longest = max(longest, n)
            admit.append(self._waiting.popleft())
        return admit

    def _take_lora_admissible(self, room: int) -> list[Request]:
        """As ``_take_admissible``, only requests of one adapter: the one merged in while rows run,
        else the oldest waiting request's (the loop switches to it before the prefill)."""
        lora = self.lora_merged if self._n_running else self._waiting[0].lora
        admit: list[Request] = []
        longest = 0
        for req in list(self._waiting):
            if len(admit) >= room:
                break
            if req.lora != lora:
                continue
            n = len(req.prompt_ids)
            if admit and (len(admit) + 1) * max(longest, n) > self.max_prefill_tokens:
                break
            longest = max(longest, n)
            self._waiting.remove(req)
            admit.append(req)
        return admit

    def _apply_aborts(self, aborts: list[tuple[str | None, str]]) -> None:
        changed = False
        for rid, message in aborts:
            for i, req in enumerate(self._rows):
                if req is not None and (rid is None or req.rid == rid):
                    self._rows[i] = None
                    self._finish(req, {"type": "abort", "message": message})
                    changed = True
        if changed:
            self._rows_changed()

    def _step(self, admit: list[Request]) -> None:
        runner = self.runner
        if admit:
            logits, new = runner.prefill([r.prompt_ids for r in admit])
            self.prefills += 1
            rp = build_row_params([r.params for r in admit], [r.generator for r in admit],
                                  logits.shape[-1], runner.device)
            tokens, lps = sample(logits, rp, self._shared_gen)
            new.last_tok = tokens
            alive = self._alive_idx if self._batch is not None else None
            self._batch = runner.merge(self._batch, alive, new)
            self._rows = [r for r in self._rows if r is not None] + admit
            self._record(range(len(self._rows) - len(admit), len(self._rows)), tokens, lps)
            self._rows_changed()  # the batch changed even when no admitted row finished
        elif self._batch is not None and len(self._alive_idx) * 4 <= 3 * len(self._rows):
            self._compact()
        if self._batch is None or self._n_running == 0:
            return
        logits = runner.decode(self._batch)  # [B, V]
        self.steps += 1
        alive = self._alive_idx
        full = len(alive) == len(self._rows)
        tokens, lps = sample(logits if full else logits[alive], self._row_params, self._shared_gen)
        if full:
            self._batch.last_tok = tokens
        else:
            self._batch.last_tok[alive] = tokens
        if self._record(alive.tolist(), tokens, lps):
            self._rows_changed()

    def _record(self, rows: Any, tokens: torch.Tensor, lps: torch.Tensor) -> bool:
        """Append each row's new token; finish the rows that are done (SGLang's check order).
        Returns whether any row finished."""
        changed = False
        for i, tok, lp in zip(rows, tokens.tolist(), lps.tolist()):
            req = self._rows[i]
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            reason = None
            if len(req.output_ids) >= req.max_tokens:
                reason = {"type": "length", "length": req.max_tokens}
            elif tok in req.stop_ids:
                reason = {"type": "stop", "matched": tok}
            elif req.params.stop:
                matched = self._match_stop_str(req)
                if matched is not None:
                    reason = {"type": "stop", "matched": matched}
            if reason is not None:
                self._rows[i] = None
                self._finish(req, reason)
                changed = True
        return changed

    def _match_stop_str(self, req: Request) -> str | None:
        # decode a tail long enough to hold any stop string (a token is at least one character
        # in practice; a few spare tokens cover byte-level pieces)
        window = max(len(s) for s in req.params.stop) + 8
        tail = self.runner.tokenizer.decode(req.output_ids[-window:],
                                            skip_special_tokens=req.params.skip_special_tokens)
        for s in req.params.stop:
            if s in tail:
                return s
        return None

    def _rows_changed(self) -> None:
        alive = [i for i, r in enumerate(self._rows) if r is not None]
        if not alive:
            self._batch, self._rows = None, []
        self._alive_idx = torch.tensor(alive, dtype=torch.long, device=self.runner.device)
        reqs = [self._rows[i] for i in alive]
        self._row_params = build_row_params([r.params for r in reqs], [r.generator for r in reqs],
                                            self.runner.vocab_size, self.runner.device) if reqs else None
        n_tokens = sum(len(r.prompt_ids) + len(r.output_ids) for r in reqs)
        with self._cv:
            self._n_running, self._n_tokens = len(alive), n_tokens

    def _compact(self) -> None:
        self._batch = self.runner.select(self._batch, self._alive_idx)
        self._rows = [r for r in self._rows if r is not None]
        self._rows_changed()

    def _finish(self, req: Request, reason: dict | None, error: BaseException | None = None) -> None:
        with self._cv:
            if self._live.get(req.rid) is req:
                del self._live[req.rid]
        req.finish_reason, req.error, req.weight_version = reason, error, self.weight_version
        self.finished += 1
        try:
            req.on_finish(req)
        except Exception:  # a broken callback must not take the loop down; it is logged
            log.exception("on_finish of %s failed", req.rid)

    def _fail_all(self, error: BaseException, extra: list[Request]) -> None:
        with self._cv:
            waiting = list(self._waiting) if self._stopping else []
            if self._stopping:
                self._waiting.clear()
        for req in [r for r in self._rows if r is not None] + list(extra) + waiting:
            if req.finish_reason is None and req.error is None:
                self._finish(req, None, error)
        self._batch, self._rows = None, []
        self._rows_changed()
