"""The public plugin API: what a plugin may reach of the rollout manager, besides its arguments.

Plugins are plain functions loaded by import path with slime's signatures (``plugins.loader``);
this module is for the few things such a signature cannot carry. Inside any function the rollout
manager calls (a rollout function, a custom generate, a reward, a hook, and the tasks and coroutines
they start):

- ``current_context()``: the manager's ``RolloutContext``: the router client (``client``), the
  in-flight limit (``semaphore``), the run's typed ``settings``, the plugins' ``args``, the
  ``tokenizer``, the manager's event ``loop``;
- ``current_step()``: the ``StepState`` of the rollout step in progress (its ``rollout_id``, its
  counters, ``stopping`` once the step winds down and a plugin should stop generating);
- ``note_weight_versions(answer)``: a custom generate that calls the engines with a client of its
  own hands their ``/generate`` answers here, so its samples get tagged with the policy versions
  that produced them when it records none itself (``seen_weight_versions()`` reads them back);
- ``note_engine_call(input_ids, answer)``: the same plugin hands each ``/generate`` call's
  ``input_ids`` and answer here, so ``--tito-check`` can check its samples against what the engines
  saw and produced (``rollout_manager/tito.py``); slime's ``post()`` does both for you.

At import time (a plugin module's top level), two registrations:

- ``register_default_rollout(fn)``: ``fn`` is only a wrapper of Reservoir's default rollout (slime's
  ``generate_rollout`` is one): when a rollout flag names it, the manager runs its default rollout;
- ``on_shutdown(fn)``: ``fn()`` (sync or async) runs when a rollout manager shuts down, on its loop
  (to close clients a plugin opened on that loop).

Context variables carry the context and step, so they reach the tasks a plugin starts, but not a
thread of its own (``threading.Thread``) or an event loop of its own (``asyncio.run`` there). From
such a thread or loop:

- ``current_context()`` finds the rollout manager of this process (when exactly one runs; else
  read it inside the rollout and ``set_context`` it on the other side), ``current_step(None)`` is
  None: the work belongs to no rollout step;
- ``await on_manager_loop(coro)`` (from a loop of its own) or ``call_on_manager_loop(coro)`` (from a
  plain thread, blocking only that thread) runs ``coro`` on the manager's event loop, where the
  router client, the in-flight ``semaphore`` and the ``running`` event live: generating there from
  another loop would fail or deadlock. slime's ``generate*``, ``post``, ``get`` and
  ``async_utils.run`` do this for you, so slime's ``fully_async`` worker thread runs unchanged;
- the data source a rollout function gets is safe to call from any thread; groups drawn outside a
  rollout step are "held by a plugin" until they come back in a rollout function's output or
  through ``add_samples``, and a checkpoint saves them as given back, so a resumed run draws each
  prompt once;
- work handed over outside a rollout step runs under the manager's detached step (its counters;
  ``stopping`` once the manager shuts down, when its requests are aborted). Failures of that work
  are counted and logged; when ``--rollout-batch-size`` of them come in a row, the rollout step in
  progress ends with ``RolloutFailed`` naming the last error (it would otherwise wait forever for
  groups that never come).

Example, a custom generate that posts to the router itself::

    from rollout_manager.plugin_api import current_context, note_weight_versions

    async def generate(args, sample, sampling_params):
        ctx = current_context()
        answer = await ctx.client.generate(input_ids=sample.tokens, sampling_params=sampling_params,
                                           return_logprob=True)
        note_weight_versions(answer)
        note_engine_call(sample.tokens, answer)
        ...

This module imports nothing of the manager at run time (the types below are annotations), so every
module of the manager, and ``slime_compat``, builds on it.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import contextvars
import inspect
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Iterator, TypeVar

from buffer.sample import parse_weight_version

if TYPE_CHECKING:
    from rollout_manager.dispatch import Dispatcher
    from rollout_manager.generate import SampleSlots
    from rollout_manager.rewards import Rewarder
    from rollout_manager.settings import RolloutSettings
    from sglang_protocol.client import EngineClient

__all__ = ["RolloutContext", "RolloutStats", "StepState", "current_context", "current_step", "set_context",
           "set_step", "note_weight_versions", "seen_weight_versions", "recording_weight_versions",
           "note_engine_call", "recording_engine_calls",
           "register_default_rollout", "is_default_rollout", "on_shutdown", "run_shutdown_hooks",
           "DetachedWork", "on_manager_loop", "call_on_manager_loop", "start_detached", "live_context"]

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


# --- what a plugin sees --------------------------------------------------------------------------
@dataclass
class RolloutStats:
    """Counters of one rollout step (or evaluation); they become its ``rollout/...`` metrics."""

    requests: int = 0  # /generate calls of the default generate (a group request counts once)
    # per answered /generate of the default generate: (seconds as the manager saw it: HTTP, router,
    # engine; seconds as the engine reports it: meta_info e2e_latency, arrival to finish, the longest
    # of a batch's elements, None if it did not say), so the rollout's requests split into the
    # engines' own time and the way there and back
    request_times: list[tuple[float, float | None]] = field(default_factory=list)
    retries: int = 0  # /generate calls retried after an engine error
    aborted_requests: int = 0  # samples whose segment came back aborted (per sample in both granularities)
    generated_tokens: int = 0
    dropped_groups: int = 0  # removed by the dynamic sampling filter
    returned_groups: int = 0  # given back to the data source unfinished
    failed_groups: int = 0  # every sample failed: not kept (failures say why)
    failures: Counter = field(default_factory=Counter)  # samples (or, for filters, groups) by reason
    tito: Counter = field(default_factory=Counter)  # --tito-check: samples checked, and by finding (tito.py)
    drop_reasons: Counter = field(default_factory=Counter)  # DynamicFilterOutput.reason of dropped groups


@dataclass
class StepState:
    """One rollout step in progress: its counters and whether it is winding down.

    A plugin reads ``rollout_id`` and ``stopping`` (True once the step has its batch and aborts what
    still runs: a plugin's own generation loop should stop then)."""

    stats: RolloutStats = field(default_factory=RolloutStats)
    stopping: bool = False
    inflight: set[str] = field(default_factory=set)  # request ids, for targeted aborts
    rollout_id: int | None = None  # the step's rollout id (what --rollout-sample-hook-path hooks get)
    handed_over: set = field(default_factory=set)  # tasks run on the manager's loop for this step's threads
    failed: str | None = None  # why the step was ended from outside (detached work kept failing)


@dataclass
class DetachedWork:
    """Work handed to the manager's loop by a plugin's own thread or loop, outside any rollout step
    (slime's fully_async worker). It runs under ``step`` (no rollout id; ``stopping`` at shutdown).
    ``failing`` is set once ``limit`` calls in a row raised: the rollout step in progress then ends
    with ``RolloutFailed`` naming ``last_error`` (no group would ever come)."""

    limit: int  # failures in a row that end the rollout step in progress (--rollout-batch-size)
    step: StepState = field(default_factory=StepState)
    tasks: set = field(default_factory=set)  # asyncio tasks running on the manager's loop
    failures: Counter = field(default_factory=Counter)  # by error type, since the manager started
    in_a_row: int = 0
    last_error: str = ""
    failing: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False  # the manager shuts down: no new work

    def succeeded(self) -> None:
        self.in_a_row = 0
        self.failing.clear()

    def failed(self, e: BaseException) -> None:
        self.failures[type(e).__name__] += 1
        self.in_a_row += 1
        self.last_error = f"{type(e).__name__}: {e}"
        log.warning("work a plugin handed to the rollout manager from its own thread failed (%d in a row): %s",
                    self.in_a_row, self.last_error)
        if self.in_a_row >= self.limit:
            self.failing.set()


@dataclass
class RolloutContext:
    """What generate and rollout functions need from the manager (one per manager, on its loop).

    For plugins: ``settings``, ``args``, ``client``, ``semaphore``, ``tokenizer``, ``loop`` and
    ``engine_urls()``, to read and use, never to replace. The other fields are the manager's own
    (its default rollout runs on them)."""

    settings: RolloutSettings  # the run's typed rollout settings
    args: argparse.Namespace  # what plugins get as args (slime's names filled in)
    client: EngineClient  # the router: custom generate functions send their requests here
    dispatcher: Dispatcher  # where the default generate sends each request (router or direct)
    engine_urls: Callable[[], list[str]]  # the current engines, for aborts
    semaphore: SampleSlots  # in-flight samples across engines (held around each custom generate call)
    rewarder: Rewarder
    generate_fn: Callable  # async generate(args, sample, sampling_params[, evaluation]) -> Sample | list[Sample]
    filter_fn: Callable | None  # filter(args, samples) -> bool | DynamicFilterOutput
    loop: asyncio.AbstractEventLoop  # the manager's event loop (the client and semaphore belong to it)
    running: asyncio.Event = field(default_factory=asyncio.Event)  # cleared while paused
    active_steps: set[int] = field(default_factory=set)  # id()s of StepStates in progress
    tokenizer: Any = None  # --hf-checkpoint's; encodes prompts that come without tokens
    sample_filter_fn: Callable | None = None  # --rollout-sample-filter-path: fn(args, kept_groups)
    all_samples_fn: Callable | None = None  # --rollout-all-samples-process-path: fn(args, groups, get_samples)
    sample_hooks: list[tuple[str, Callable]] = field(default_factory=list)  # --rollout-sample-hook-path, in order
    paths: dict[str, str] = field(default_factory=dict)  # flag -> import path, for failure reports
    tito: Any = None  # --tito-check's TitoChecker (rollout_manager/tito.py), None when off
    detached: DetachedWork | None = None  # work of plugins' own threads and loops (the manager sets it)
    teacher: Any = None  # on-policy distillation's teacher (rollout_manager/teacher.py), None when off
    agent_env: Any = None  # --agent-env's environment (rollout_manager/agent.py), None without one


# --- the current context and step ----------------------------------------------------------------
_MISSING: Any = object()
_CONTEXT: contextvars.ContextVar[RolloutContext] = contextvars.ContextVar("reservoir_rollout_context")
_STEP: contextvars.ContextVar[StepState] = contextvars.ContextVar("reservoir_rollout_step")


_LIVE: list[RolloutContext] = []  # the started rollout managers of this process


def current_context(default: Any = _MISSING) -> RolloutContext:
    """The rollout manager's context, inside a function the manager runs (and the tasks it starts);
    in a thread or event loop of a plugin's own, the rollout manager of this process
    (``live_context``).

    Elsewhere, ``default`` when given (``current_context(None)`` asks "am I inside a rollout?"),
    else ``RuntimeError``."""
    ctx = _CONTEXT.get(None)
    if ctx is None:
        ctx = live_context()
    if ctx is None:
        if default is _MISSING:
            raise RuntimeError("no rollout context: call this from a function the RolloutManager runs")
        return default
    return ctx


def live_context() -> RolloutContext | None:
    """The context of the one rollout manager started in this process, when the caller is not on
    its event loop (a plugin's own thread or loop); else None (on the manager's loop, outside a
    function the manager runs, or with several managers: set the context there with ``set_context``)."""
    with _lock:
        live = list(_LIVE)
    if len(live) != 1:
        return None
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    return live[0] if running is not live[0].loop else None


def register_live_context(ctx: RolloutContext) -> None:
    """The manager's: ``ctx`` is started (``live_context`` may answer it) until ``unregister``."""
    with _lock:
        _LIVE.append(ctx)


def unregister_live_context(ctx: RolloutContext) -> None:
    """The manager's, at shutdown."""
    with _lock:
        if ctx in _LIVE:
            _LIVE.remove(ctx)


def current_step(default: Any = _MISSING) -> StepState:
    """The rollout step in progress (see ``StepState``); outside one, ``default`` when given, else
    ``RuntimeError``. A rollout function's step exists for its whole call, a custom generate's for
    the step that called it."""
    step = _STEP.get(default)
    if step is _MISSING:
        raise RuntimeError("no rollout step in progress")
    return step


def set_context(ctx: RolloutContext) -> contextvars.Token:
    """Make ``ctx`` the current context of this task or thread (and the tasks it starts from now on).

    The manager sets it before it calls a plugin; a plugin sets it on a thread or event loop of its
    own, with the context it read inside the rollout. Returns the token for ``ContextVar.reset``."""
    return _CONTEXT.set(ctx)


def set_step(step: StepState) -> contextvars.Token:
    """Make ``step`` the current rollout step of this task or thread (as ``set_context``)."""
    return _STEP.set(step)


# --- a plugin's own thread or event loop ----------------------------------------------------------
T = TypeVar("T")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _handed_over(ctx: RolloutContext, step: StepState | None, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the manager's loop as work of ``step`` (None: detached work, see
    ``DetachedWork``), with the context set; the task is tracked so that the step's end or the
    manager's shutdown can stop it."""
    set_context(ctx)
    work = ctx.detached
    if step is None:
        if work is None or work.closed:
            coro.close()
            raise RuntimeError("the rollout manager is shutting down: it takes no new work")
        owner = work.tasks
        set_step(work.step)
    else:
        owner = step.handed_over
        set_step(step)
    task = asyncio.current_task()
    owner.add(task)
    try:
        out = await coro
    except Exception as e:
        if step is None:
            work.failed(e)
        raise
    finally:
        owner.discard(task)
    if step is None:
        work.succeeded()
    return out


def _manager_context(what: str, coro: Coroutine[Any, Any, Any]) -> RolloutContext:
    """The rollout manager's context for handing ``coro`` over; without one ``coro`` is closed (it
    never runs: no "never awaited" warning) and RuntimeError names ``what``."""
    ctx = current_context(None)
    if ctx is None:
        coro.close()
        raise RuntimeError(f"{what}: no rollout context: no rollout manager runs in this process (or several "
                           "do: set_context(ctx) in this thread first)")
    return ctx


async def on_manager_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` run on the rollout manager's event loop, from any event loop.

    On the manager's loop it is simply awaited. On a loop of a plugin's own (a worker thread's
    ``asyncio.run``) it is handed to the manager's loop (``asyncio.run_coroutine_threadsafe``) with
    the rollout context, and with the caller's step, or the manager's detached step when the caller
    has none; only the caller's loop waits, the manager's never blocks. Cancelling the await cancels
    the work there. This is how generation, ``post()`` and anything using the manager's client,
    ``semaphore`` or ``running`` event can be called from a plugin's own loop: those belong to the
    manager's loop and would fail (or deadlock) on another one.

    Raises ``RuntimeError`` when no rollout manager is found (see ``current_context``) or once it
    shuts down; the work's own exception otherwise."""
    ctx = _manager_context("on_manager_loop", coro)
    if _running_loop() is ctx.loop:
        return await coro
    fut = asyncio.run_coroutine_threadsafe(_handed_over(ctx, current_step(None), coro), ctx.loop)
    return await asyncio.wrap_future(fut)


def call_on_manager_loop(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the rollout manager's event loop and block this thread until it is done (the
    blocking twin of ``on_manager_loop``, for a plain thread: a slime rollout function, a worker).

    ``timeout``: seconds before ``TimeoutError`` (the work is then cancelled). Raises
    ``RuntimeError`` when called on the manager's loop itself (it would block it: await the
    coroutine instead), when no manager is found, or when the rollout step it belongs to was ended
    (its message says why)."""
    ctx = _manager_context("call_on_manager_loop", coro)
    if _running_loop() is ctx.loop:
        coro.close()
        raise RuntimeError("call_on_manager_loop blocks: it was called on the rollout manager's event loop "
                           "(from async code, await the coroutine instead)")
    step = current_step(None)
    fut = asyncio.run_coroutine_threadsafe(_handed_over(ctx, step, coro), ctx.loop)
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError:
        fut.cancel()
        raise TimeoutError(f"call_on_manager_loop: not done within {timeout:g} s") from None
    except concurrent.futures.CancelledError:
        why = step.failed if step is not None and step.failed else "it was cancelled"
        raise RuntimeError(f"call_on_manager_loop: the work was stopped: {why}") from None


def start_detached(coro: Coroutine[Any, Any, Any]) -> "asyncio.Future[Any] | concurrent.futures.Future[Any]":
    """Start ``coro`` on the rollout manager's loop as detached work (of no rollout step: a pool of
    generations that outlives a step, as slime's fully_async keeps); returns its asyncio task (when
    called on the manager's loop) or a ``concurrent.futures.Future`` (from another thread). It runs
    under the manager's detached step: counted, stopped at shutdown (its requests aborted first)."""
    ctx = _manager_context("start_detached", coro)
    if _running_loop() is ctx.loop:  # a fresh context: the caller's step and recordings stay with it
        return ctx.loop.create_task(_handed_over(ctx, None, coro), context=contextvars.Context())
    return asyncio.run_coroutine_threadsafe(_handed_over(ctx, None, coro), ctx.loop)


# --- the weight versions a sample's requests saw -------------------------------------------------
_SEEN_VERSIONS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("reservoir_seen_versions",
                                                                                  default=None)


def note_weight_versions(answer: Any) -> None:
    """Note the ``meta_info.weight_version`` of a ``/generate`` answer (one answer, or a batch's
    list) for the sample being generated. After a custom generate returns, a sample of it that
    recorded no ``weight_versions`` itself is tagged with the versions noted during the call.
    Outside a generate call, and for answers without a version, it does nothing."""
    seen = _SEEN_VERSIONS.get()
    if seen is None:
        return
    for out in answer if isinstance(answer, list) else [answer]:
        meta = out.get("meta_info") if isinstance(out, dict) else None
        if isinstance(meta, dict) and "weight_version" in meta:
            try:
                seen.append(parse_weight_version(meta["weight_version"]))
            except RuntimeError:
                pass  # not a version: the sample is not tagged with it


def seen_weight_versions() -> list[int]:
    """The weight versions noted so far for the sample being generated, in order (a copy; empty
    outside a generate call)."""
    return list(_SEEN_VERSIONS.get() or ())


@contextlib.contextmanager
def recording_weight_versions() -> Iterator[list[int]]:
    """Collect the versions ``note_weight_versions`` notes inside the block (the manager wraps each
    custom generate call in one); yields the list they are appended to."""
    seen: list[int] = []
    token = _SEEN_VERSIONS.set(seen)
    try:
        yield seen
    finally:
        _SEEN_VERSIONS.reset(token)


# --- the engine calls a sample's requests made ----------------------------------------------------
_ENGINE_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar("reservoir_engine_calls", default=None)


def note_engine_call(input_ids: Any, answer: Any) -> None:
    """Note one ``/generate`` call of the sample being generated: the ``input_ids`` sent (a batch's
    list of lists with a batch's list of answers) and the engine's answer. A copy of the ids is
    kept, so the caller may go on growing its list. After a custom generate returns, the calls
    become the sample's engine records (``rollout_manager.tito``). Outside a generate call, and for
    answers without ``output_ids`` or ``meta_info``, it does nothing."""
    calls = _ENGINE_CALLS.get()
    if calls is None or input_ids is None:
        return
    pairs = zip(input_ids, answer) if isinstance(answer, list) else [(input_ids, answer)]
    for ids, out in pairs:
        meta = out.get("meta_info") if isinstance(out, dict) else None
        if not isinstance(meta, dict):
            continue
        output_ids = out.get("output_ids")
        if output_ids is None and meta.get("output_token_logprobs"):
            output_ids = [x[1] for x in meta["output_token_logprobs"]]
        if output_ids is not None:
            calls.append((tuple(int(t) for t in ids), [int(t) for t in output_ids], meta))


@contextlib.contextmanager
def recording_engine_calls() -> Iterator[list]:
    """Collect the calls ``note_engine_call`` notes inside the block (the manager wraps each custom
    generate call in one); yields the list of ``(input_ids, output_ids, meta_info)``."""
    calls: list = []
    token = _ENGINE_CALLS.set(calls)
    try:
        yield calls
    finally:
        _ENGINE_CALLS.reset(token)


# --- registrations -------------------------------------------------------------------------------
_lock = threading.Lock()
_default_rollouts: list[Callable] = []
_shutdown_hooks: list[Callable[[], Any]] = []


def register_default_rollout(fn: F) -> F:
    """Declare the rollout function ``fn`` a wrapper of Reservoir's default rollout; returns ``fn``
    (so it works as a decorator).

    When ``--rollout-function-path`` or ``--eval-function-path`` names a registered function, the
    manager does not call it: it runs its default rollout itself, on its event loop (progress per
    group, the step's filter and failure metrics), which is what the wrapper would do from a worker
    thread. Anyone else calling ``fn`` still gets ``fn``. Register at the plugin module's top level,
    so the registration exists once the loader has imported the module."""
    with _lock:
        if not any(f is fn for f in _default_rollouts):
            _default_rollouts.append(fn)
    return fn


def is_default_rollout(fn: Callable) -> bool:
    """Whether ``fn`` was registered with ``register_default_rollout`` (the manager's own
    ``rollout_manager.rollout.generate_rollout`` is)."""
    with _lock:
        return any(f is fn for f in _default_rollouts)


def on_shutdown(fn: F) -> F:
    """Run ``fn()`` (a plain or an async function, no arguments) whenever a rollout manager shuts
    down, on the manager's event loop, after its engines and router have stopped; returns ``fn`` (a
    decorator). For what a plugin opened on that loop (an HTTP client). Registering the same
    function again does nothing; a hook that raises is logged and the others still run."""
    with _lock:
        if not any(f is fn for f in _shutdown_hooks):
            _shutdown_hooks.append(fn)
    return fn


async def run_shutdown_hooks() -> None:
    """Run the ``on_shutdown`` hooks in the order they were registered (the manager's shutdown)."""
    with _lock:
        hooks = list(_shutdown_hooks)
    for fn in hooks:
        try:
            out = fn()
            if inspect.isawaitable(out):
                await out
        except Exception:  # noqa: BLE001 - one plugin's cleanup must not skip the others'
            log.exception("shutdown hook %s.%s failed", getattr(fn, "__module__", "?"),
                          getattr(fn, "__qualname__", repr(fn)))
