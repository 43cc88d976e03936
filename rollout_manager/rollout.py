"""The default rollout: groups of samples, rewards, dynamic-sampling filter, over-sampling, aborts.

``run_rollout`` is the async core the manager awaits. ``generate_rollout`` is the same thing behind
slime's synchronous plugin signature ``generate_rollout(args, rollout_id, data_source,
evaluation=False) -> list[list[Sample]]`` (the manager calls plugins from a worker thread).

One step keeps starting groups (``--over-sampling-batch-size`` prompts at a time) while the kept
groups plus the groups in flight are fewer than ``--rollout-batch-size``; groups the filter
rejects are dropped and counted. With the default generate, a group's unfinished samples go to the
engines as one batch request (``--rollout-request-granularity group``; ``sample``: one each).
When enough groups are kept, the requests still running are aborted and their groups go back to the data source: with ``--partial-rollout`` they resume later
from the tokens generated so far, otherwise they restart from the prompt. No prompt is lost.

Custom generate functions (``--custom-generate-function-path``, or a sample's
``generate_function_path``) are called as slime's ``generate_and_rm`` calls them: one in-flight
slot held around the whole call, ``evaluation=`` passed when the function takes it, and a list of
samples accepted (slime's fan-out: they join the group and count as one rollout execution,
``Sample.rollout_id``). A plugin that raises or runs past its timeout (generate, reward, filter, the
sample hooks: ``--custom-generate-timeout``, ``--reward-timeout``, ``--filter-timeout``) fails only
the sample or group it was working on: it is logged with the plugin's flag and path, counted under
``failures/<reason>``, and the step goes on. Plain-function plugins run in plugin threads
(``plugin_calls``), so a blocking one never stalls the event loop. A group whose samples all failed is never kept; a
step that cannot get enough groups past the failures and the filter ends with ``RolloutFailed``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import logging
import time
import uuid
from typing import Any, Callable

from buffer.sample import Sample, Status, check_sample
from sglang_protocol.client import EngineClient, EngineError, new_session
from rollout_manager.generate import MAX_IDLE_ABORTS, generate, generate_group, reset_sample, sampling_params
from rollout_manager.plugin_api import (RolloutContext, StepState, current_context, current_step,
                                        recording_engine_calls, recording_weight_versions, register_default_rollout,
                                        set_context, set_step)
from rollout_manager.plugin_calls import PluginTimeout, call_plugin
from rollout_manager.rewards import mark_failed
from rollout_manager.tito import spans_from_calls

log = logging.getLogger(__name__)
_DONE = (Status.COMPLETED, Status.TRUNCATED, Status.FAILED)
_SCORABLE = (Status.COMPLETED, Status.TRUNCATED)


class RolloutFailed(RuntimeError):
    """A step could not collect ``--rollout-batch-size`` groups (too many failed or were dropped), or
    the rollout function itself raised. ``step`` holds the step's counters (the manager adds
    ``metrics`` for the summary)."""

    def __init__(self, message: str, step: StepState | None = None):
        super().__init__(message)
        self.step = step
        self.metrics: dict[str, float] = {}


# --- one sample --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _load_generate(path: str) -> Callable:
    from plugins.loader import load_function

    return load_function(path, "generate_function_path", params=["args", "sample", "sampling_params"], is_async=True)


@functools.lru_cache(maxsize=64)
def _takes_evaluation(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "evaluation" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _generate_fn(ctx: RolloutContext, sample: Sample) -> tuple[Callable, str]:
    """The generate function for ``sample`` and its path (for reports): a per-sample
    ``generate_function_path`` (slime's eval-dataset override) first, then the manager's."""
    if sample.generate_function_path:
        return _load_generate(sample.generate_function_path), sample.generate_function_path
    return ctx.generate_fn, ctx.paths.get("--custom-generate-function-path", "rollout_manager.generate.generate")


def ensure_prompt_tokens(ctx: RolloutContext, sample: Sample) -> None:
    """A sample from a data source of the user's may carry only its prompt text: encode it (with
    the chat template for a message list), as slime's default generate does."""
    if sample.tokens or ctx.tokenizer is None:
        return
    prompt = sample.prompt
    if isinstance(prompt, list):
        prompt = ctx.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False,
                                                   **(sample.apply_chat_template_kwargs or {}))
    sample.tokens = list(ctx.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    sample.response_length = 0


def _as_samples(out: Any) -> list[Sample]:
    if isinstance(out, Sample):
        return [out]
    if isinstance(out, list) and out and all(isinstance(x, Sample) for x in out):
        return out
    what = f"a list of {sorted({type(x).__name__ for x in out})}" if isinstance(out, list) and out else \
        ("an empty list" if isinstance(out, list) else type(out).__name__)
    raise TypeError(f"generate function returned {what}, not a Sample or a non-empty list of Samples")


def _finish_generated(x: Sample, origin: Sample, seen: list[int], fanout: bool, calls: list) -> None:
    """Bring a custom generate's output to the contract, as slime's training-data conversion does
    (a missing loss mask is all ones), tag it with the policy versions its requests saw, and record
    its engine calls for --tito-check (not for a fan-out: which call made which sample is unknown)."""
    if x.loss_mask is None:
        x.loss_mask = [1] * x.response_length
    if not x.weight_versions and seen:
        x.weight_versions = list(dict.fromkeys(seen))
    if fanout:
        if x.rollout_id is None:
            x.rollout_id = origin.index
        if x.group_index is None:
            x.group_index = origin.group_index
    elif calls:
        spans_from_calls(x, calls)
    _check_generated(x)


async def generate_one(ctx: RolloutContext, sample: Sample, params: dict, evaluation: bool = False) -> list[Sample]:
    """Generate and score one sample (slime's ``generate_and_rm``); a fan-out returns several samples.

    The default generate is called as is (it takes its own slots, resumes aborted requests); a
    custom one runs holding one in-flight slot, and if it hands back an aborted sample while the
    step goes on (engines paused for a weight update, or an engine aborted it) it is called again."""
    return (await generate_sample(ctx, sample, params, evaluation))[0]


async def generate_sample(ctx: RolloutContext, sample: Sample, params: dict,
                          evaluation: bool = False) -> tuple[list[Sample], bool]:
    """``generate_one``, and whether the generate function returned a list (a fan-out)."""
    if sample.status in _DONE:
        return [sample], False  # finished in an earlier step (its group was given back unfinished)
    fn, path = _generate_fn(ctx, sample)
    custom = fn is not generate
    ensure_prompt_tokens(ctx, sample)
    if custom and sample.session_id is None:
        sample.session_id = uuid.uuid4().hex  # slime's generate_and_rm_group gives each sample one
    aborts = 0
    while True:
        # what the plugin's own requests saw (plugin_api)
        with recording_weight_versions() as seen, recording_engine_calls() as calls:
            try:
                if custom:
                    kwargs = {"evaluation": evaluation} if _takes_evaluation(fn) else {}
                    async with ctx.semaphore:  # slime holds its semaphore around the whole custom call
                        out = await call_plugin(fn, ctx.args, sample, dict(params), **kwargs,
                                                what=f"--custom-generate-function-path {path}",
                                                timeout=ctx.settings.plugins.custom_generate_timeout)
                else:
                    out = await fn(ctx.args, sample, dict(params))
                outs = _as_samples(out)
                fanout = isinstance(out, list)
                for x in outs:
                    _finish_generated(x, sample, seen, fanout, calls)
            except Exception as e:  # a custom generate's bug fails this sample only; logged and counted
                _fail_generated(sample, e, "--custom-generate-function-path" if custom else "generate", path,
                                reason="generate: timeout" if isinstance(e, PluginTimeout) else None)
                return [sample], False
        step = current_step(None)
        if custom and any(x.status == Status.ABORTED for x in outs) and not (step is not None and step.stopping):
            aborts += 1
            if aborts > MAX_IDLE_ABORTS:
                _fail_generated(sample, RuntimeError(f"aborted {aborts} times"), "--custom-generate-function-path",
                                path, reason="engine: aborted")
                return [sample], False
            await ctx.running.wait()  # a weight update's pause: call it again under the new weights
            if not ctx.settings.sampling.partial_rollout:
                reset_sample(sample)
            sample.status = Status.PENDING
            continue
        break
    outs = [await _apply_sample_hooks(ctx, x, evaluation) for x in outs]
    await _check_tito(ctx, outs)
    if not ctx.rewarder.group_rm:
        await asyncio.gather(*(_score(ctx, x) for x in outs))
    return outs, fanout


async def _apply_sample_hooks(ctx: RolloutContext, sample: Sample, evaluation: bool) -> Sample:
    """slime's ``--rollout-sample-hook-path`` hooks on one generated sample, in order, before its
    reward: ``hook(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None`` (None keeps
    the sample; the keywords it does not declare are left out). A hook that raises, runs past
    ``--filter-timeout`` or returns something else fails that sample, counted."""
    if not ctx.sample_hooks or sample.status not in _SCORABLE:
        return sample
    step = current_step(None)
    offered = {"rollout_id": step.rollout_id if step is not None else None, "evaluation": evaluation}
    for path, hook in ctx.sample_hooks:
        try:
            out = await call_plugin(hook, ctx.args, sample, **_accepted_kwargs(hook, offered),
                                    what=f"--rollout-sample-hook-path {path}",
                                    timeout=ctx.settings.plugins.filter_timeout)
            if out is not None and not isinstance(out, Sample):
                raise TypeError(f"returned {type(out).__name__}, expected a Sample or None")
        except Exception as e:  # noqa: BLE001 - this sample fails, counted; the step goes on
            reason = "sample hook: timeout" if isinstance(e, PluginTimeout) else f"sample hook: {type(e).__name__}"
            _fail_generated(sample, e, "--rollout-sample-hook-path", path, reason=reason)
            return sample
        sample = out if out is not None else sample
    return sample


async def _check_tito(ctx: RolloutContext, samples: list[Sample]) -> None:
    """--tito-check on finished samples, before their reward (in fail mode a hard error fails the
    sample, counted under its reason); counts go to the step's ``tito`` counters. The checks render
    chat templates: they run in a thread, never on the event loop."""
    step = current_step(None)
    if ctx.tito is None or step is None:
        return
    todo = [x for x in samples if ctx.tito.wants(x)]
    if todo:
        reports = await asyncio.to_thread(lambda: [ctx.tito.check(x) for x in todo])
        for x, report in zip(todo, reports):
            ctx.tito.settle(x, report, step.stats.tito)


def _accepted_kwargs(fn: Callable, offered: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
        return offered
    names = {p.name for p in params}
    return {k: v for k, v in offered.items() if k in names}


async def _generate_group(ctx: RolloutContext, group: list[Sample], params: dict,
                          evaluation: bool = False) -> list[Sample]:
    """The group's unfinished samples through ``generate_group`` (batch requests), then scored."""
    todo = [x for x in group if x.status not in _DONE]
    if todo:
        for x in todo:
            ensure_prompt_tokens(ctx, x)
        try:
            await generate_group(ctx.args, todo, dict(params))
        except Exception as e:  # a bug here must not lose the group: its samples fail, counted
            log.exception("group generate failed for samples %s", [x.index for x in todo])
            for x in todo:
                if x.status not in (*_DONE, Status.ABORTED):
                    _fail_generated(x, e, "generate", "rollout_manager.generate.generate_group")
        for x in todo:
            try:
                _check_generated(x)
            except Exception as e:
                _fail_generated(x, e, "generate", "rollout_manager.generate.generate_group")
        hooked = {id(x): await _apply_sample_hooks(ctx, x, evaluation) for x in todo}
        group = [hooked.get(id(x), x) for x in group]
        todo = [hooked[id(x)] for x in todo]
        await _check_tito(ctx, todo)
        if not ctx.rewarder.group_rm:
            await asyncio.gather(*(_score(ctx, x) for x in todo))
    return group


def _check_generated(sample: Sample) -> None:
    if sample.status == Status.PENDING:
        raise ValueError("generate function left the sample's status 'pending'")
    if sample.status in _SCORABLE:
        check_sample(sample, f"sample {sample.index}", check_reward=sample.reward is not None)


def _fail_generated(sample: Sample, e: Exception, flag: str, path: str, reason: str | None = None) -> None:
    log.warning("%s %s failed on sample %s (group %s): %s: %s", flag, path, sample.index, sample.group_index,
                type(e).__name__, e)
    try:
        _check_shape(sample)
    except ValueError:  # left half-written: keep only the prompt (and the versions it saw)
        versions = list(sample.weight_versions)
        reset_sample(sample)
        sample.weight_versions = versions
    mark_failed(sample, reason or f"generate: {type(e).__name__}")


async def _score(ctx: RolloutContext, sample: Sample) -> None:
    if sample.status in _SCORABLE and sample.reward is None:
        await ctx.rewarder.score(sample)


def _check_shape(sample: Sample) -> None:
    """check_sample without the reward (not scored yet)."""
    check_sample(sample, f"sample {sample.index}", check_reward=False)


# --- one group ---------------------------------------------------------------------------------
async def generate_and_score_group(ctx: RolloutContext, group: list[Sample], params: dict,
                                   evaluation: bool = False) -> list[Sample]:
    """Generate and score one group (slime's ``generate_and_rm_group``); a custom generate's fan-out
    makes the group longer. Unfinished samples (aborted by a stopping step) are left unscored."""
    if ctx.generate_fn is generate and ctx.settings.sampling.rollout_request_granularity == "group" \
            and not any(x.generate_function_path for x in group):
        group = await _generate_group(ctx, group, params, evaluation)
    else:  # per sample: --rollout-request-granularity sample, or a custom generate function
        outs = await asyncio.gather(*(generate_one(ctx, s, params, evaluation) for s in group))
        group = [x for out in outs for x in out]
    if ctx.rewarder.group_rm and all(s.status in _DONE for s in group):
        await ctx.rewarder.score_group([s for s in group if s.reward is None])
    if ctx.teacher is not None and not evaluation and all(s.status in _DONE for s in group):
        await ctx.teacher.score_group(group, ctx.settings.sampling.rollout_temperature)
    return group


async def process_group(ctx: RolloutContext, group: list[Sample], params: dict,
                        evaluation: bool) -> tuple[list[Sample], bool]:
    """Generate and score one group; returns (group, finished): whether every sample ended
    (completed, truncated or failed). The dynamic-sampling filter runs in ``run_rollout``."""
    group = await generate_and_score_group(ctx, group, params, evaluation)
    return group, all(s.status in _DONE for s in group)


def _verdict(out: Any) -> tuple[bool, str | None, bool]:
    """A filter's answer as (keep, reason, keep_when_insufficient): slime's ``DynamicFilterOutput``
    (any object with ``keep``) is read field by field, never truth-tested; a plain value is ``keep``."""
    if hasattr(out, "keep"):
        return bool(out.keep), getattr(out, "reason", None), bool(getattr(out, "keep_when_insufficient", False))
    return bool(out), None, False


async def _apply_filter(ctx: RolloutContext, group: list[Sample], step: StepState, spare: bool) -> bool:
    """Whether the filter keeps ``group``; ``spare``: other candidates can still fill the batch
    (else a rejected group flagged ``keep_when_insufficient`` is kept, as in slime). The filter runs
    in a plugin thread, within ``--filter-timeout``."""
    flag = "--dynamic-sampling-filter-path"
    try:
        keep, reason, keep_when_insufficient = _verdict(await call_plugin(
            ctx.filter_fn, ctx.args, group, timeout=ctx.settings.plugins.filter_timeout,
            what=f"{flag} {ctx.paths.get(flag)}"))
    except Exception as e:  # the user's filter: this group is dropped, the failure reported and counted
        log.warning("%s %s failed on group %s: %s: %s", flag, ctx.paths.get(flag), group[0].group_index,
                    type(e).__name__, e)
        step.stats.failures[_plugin_failure("filter", e)] += 1
        return False
    if not keep and keep_when_insufficient and not spare:
        return True
    if not keep and reason:
        step.stats.drop_reasons[str(reason)] += 1
    return keep


async def _call_hook(ctx: RolloutContext, flag: str, fn: Callable, step: StepState, *args: Any) -> None:
    """A step-level hook of the user's, in a plugin thread within ``--filter-timeout``; an exception
    or a timeout is reported and counted, the step goes on."""
    try:
        await call_plugin(fn, *args, timeout=ctx.settings.plugins.filter_timeout, what=f"{flag} {ctx.paths.get(flag)}")
    except Exception as e:
        log.warning("%s %s failed on rollout step's %d groups: %s: %s", flag, ctx.paths.get(flag), len(args[1]),
                    type(e).__name__, e)
        step.stats.failures[_plugin_failure(flag.lstrip('-').removesuffix('-path'), e)] += 1


def _plugin_failure(what: str, e: Exception) -> str:
    """The failure reason counted for a plugin call: ``<what>: timeout`` or ``<what>: <error type>``."""
    return f"{what}: {'timeout' if isinstance(e, PluginTimeout) else type(e).__name__}"


async def abort_requests(urls: list[str], rids: list[str] | None, admin_api_key: str | None = None) -> None:
    """Abort requests ``rids`` on every engine in ``urls`` (``None``: every request).
    ``admin_api_key``: the engines' key for admin calls (``/abort_request`` is one)."""
    session = new_session()
    try:
        async def one(url: str) -> None:
            c = EngineClient(url, timeout=10, session=session, admin_api_key=admin_api_key)
            try:
                if rids is None:
                    await c.abort_request(abort_all=True)
                else:
                    await asyncio.gather(*(c.abort_request(rid=r) for r in rids))
            except EngineError as e:  # a dead engine has nothing left to abort
                log.warning("abort on %s failed: %s", url, e)
        await asyncio.gather(*(one(u) for u in urls))
    finally:
        await session.close()


def _all_failed(group: list[Sample]) -> bool:
    return all(s.status == Status.FAILED for s in group)


def _count_failed_group(step: StepState, group: list[Sample]) -> None:
    """A group not kept because every sample failed: counted, with its samples' reasons."""
    step.stats.failed_groups += 1
    for x in group:
        step.stats.failures[x.metadata.get("failure_reason", "unknown")] += 1


def _failure_text(step: StepState) -> str:
    top = ", ".join(f"{r} x{n}" for r, n in step.stats.failures.most_common(3))
    return f"failures: {top}" if top else "no failures"


async def run_rollout(ctx: RolloutContext, rollout_id: int, data_source: Any, evaluation: bool = False,
                      on_group: Callable[[list[Sample], bool], None] | None = None
                      ) -> tuple[list[list[Sample]], StepState, float]:
    """One rollout step (or a full pass over the eval data): returns (groups, step state, seconds).

    ``on_group(group, kept)`` is called as each group finishes (progress bars)."""
    set_context(ctx)
    step = StepState(rollout_id=rollout_id)
    set_step(step)  # the group tasks below copy this context
    ctx.active_steps.add(id(step))
    s = ctx.settings.sampling
    params = sampling_params(ctx.settings, evaluation)
    target = None if evaluation else s.rollout_batch_size
    chunk = (s.over_sampling_batch_size or s.rollout_batch_size) if not evaluation else 1 << 30
    use_filter = ctx.filter_fn is not None and not evaluation
    kept: list[list[Sample]] = []
    seen: list[list[Sample]] = []  # every finished group, kept or dropped (--rollout-all-samples-process-path)
    pending: set[asyncio.Task] = set()
    finished: asyncio.Queue[asyncio.Task] = asyncio.Queue()
    t0 = time.perf_counter()
    try:
        while target is None or len(kept) < target:
            if (len(kept) + len(pending) < target) if target is not None else not data_source.exhausted:
                for g in data_source.get_samples(chunk):
                    task = asyncio.ensure_future(process_group(ctx, g, params, evaluation))
                    task.add_done_callback(finished.put_nowait)
                    pending.add(task)
            if not pending:
                if target is not None:
                    log.warning("rollout %d: prompts exhausted with %d/%d groups", rollout_id, len(kept), target)
                break
            # one finished group at a time from a queue: O(1) each (asyncio.wait over the pending set
            # is O(pending) per call, quadratic over a large step)
            done = [await finished.get()]
            pending.difference_update(done)
            for t in done:
                group, complete = t.result()
                if not complete:  # a custom generate gave up mid-way: the prompt goes back, nothing is lost
                    _give_back(ctx, group, data_source, step)
                    if on_group is not None:
                        on_group(group, False)
                    continue
                if target is not None and _all_failed(group):
                    keep = False
                    _count_failed_group(step, group)
                else:
                    seen.append(group)
                    keep = not use_filter or await _apply_filter(ctx, group, step,
                                                                 spare=len(kept) + len(pending) >= target)
                    if not keep:
                        step.stats.dropped_groups += 1
                if keep:
                    kept.append(group)
                if target is not None and not keep:
                    _check_progress(rollout_id, step, kept, target, s.max_dropped_ratio)
                if on_group is not None:
                    on_group(group, keep)
        if pending:
            await _wind_down(ctx, step, pending, data_source)
    except Exception:
        if pending:  # a failing step still hands its unfinished prompts back before raising
            await _wind_down(ctx, step, pending, data_source)
        raise
    finally:
        ctx.active_steps.discard(id(step))
        for t in pending:
            t.cancel()
    if not evaluation:
        if ctx.sample_filter_fn is not None:  # slime: marks samples remove_sample (kept, no loss)
            await _call_hook(ctx, "--rollout-sample-filter-path", ctx.sample_filter_fn, step, ctx.args, kept)
        if ctx.all_samples_fn is not None:  # slime passes the data source's get_samples here
            await _call_hook(ctx, "--rollout-all-samples-process-path", ctx.all_samples_fn, step, ctx.args, seen,
                             data_source.get_samples)
    return kept, step, time.perf_counter() - t0


def _check_progress(rollout_id: int, step: StepState, kept: list, target: int, max_ratio: float) -> None:
    """End the step when failures and the filter leave no hope of a full batch."""
    st = step.stats
    if st.failed_groups >= target and not kept:
        raise RolloutFailed(f"rollout {rollout_id}: every sample of the first {st.failed_groups} groups failed "
                            f"({_failure_text(step)}); no group was kept", step)
    if st.dropped_groups + st.failed_groups > max_ratio * target:
        raise RolloutFailed(
            f"rollout {rollout_id}: {st.dropped_groups} groups were dropped by the dynamic sampling filter and "
            f"{st.failed_groups} failed entirely, {len(kept)}/{target} kept (--dynamic-sampling-max-dropped-ratio "
            f"{max_ratio}); check the filter and the rewards ({_failure_text(step)})", step)


def _give_back(ctx: RolloutContext, group: list[Sample], data_source: Any, step: StepState) -> None:
    for x in group:
        if x.status == Status.ABORTED:
            if not ctx.settings.sampling.partial_rollout:
                reset_sample(x)
            else:
                x.status = Status.PENDING  # resumes from its tokens next time
    data_source.add_samples([group])
    step.stats.returned_groups += 1


async def _wind_down(ctx: RolloutContext, step: StepState, pending: set[asyncio.Task], data_source: Any) -> None:
    """Abort what is still running; give every unfinished group back to the data source."""
    step.stopping = True
    # abort_all when this is the only step running (one request per engine), else just ours
    only_step = ctx.active_steps == {id(step)} and not (ctx.detached is not None and ctx.detached.tasks)
    e = ctx.settings.engines
    await abort_requests(ctx.engine_urls(), None if only_step else list(step.inflight), e.admin_api_key or e.api_key)
    done, still = await asyncio.wait(pending, timeout=ctx.settings.sampling.request_timeout)
    if still:
        raise RuntimeError(f"{len(still)} group(s) did not stop within {ctx.settings.sampling.request_timeout}s "
                           "of being aborted")
    for t in done:
        group, complete = t.result()
        if complete and _all_failed(group):
            _count_failed_group(step, group)
            continue
        if complete and ctx.filter_fn is not None and not await _apply_filter(ctx, group, step, spare=True):
            step.stats.dropped_groups += 1
            continue
        # finished groups the filter keeps go back as they are (not generated again; the next step
        # takes them first), unfinished ones resume or restart
        _give_back(ctx, group, data_source, step)
    pending.clear()


@register_default_rollout  # named by --rollout-function-path, the manager awaits run_rollout instead
def generate_rollout(args: argparse.Namespace, rollout_id: int, data_source: Any,
                     evaluation: bool = False) -> list[list[Sample]]:
    """slime's rollout-function signature around ``run_rollout`` (call it from a worker thread)."""
    ctx = current_context()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is ctx.loop:
        raise RuntimeError("generate_rollout blocks: call it from a worker thread, or await run_rollout")
    fut = asyncio.run_coroutine_threadsafe(run_rollout(ctx, rollout_id, data_source, evaluation), ctx.loop)
    return fut.result()[0]
