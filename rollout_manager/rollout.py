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
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any, Callable

from buffer.sample import Sample, Status, check_sample
from rollout_manager.engine_client import EngineClient, EngineError, new_session
from rollout_manager.generate import (RolloutContext, StepState, current_context, generate, generate_group,
                                      reset_sample, sampling_params, set_context, set_step)
from rollout_manager.rewards import mark_failed

log = logging.getLogger(__name__)
_DONE = (Status.COMPLETED, Status.TRUNCATED, Status.FAILED)


async def _generate_one(ctx: RolloutContext, sample: Sample, params: dict) -> Sample:
    if sample.status in _DONE:
        return sample  # finished in an earlier step (its group was given back unfinished)
    try:
        out = await ctx.generate_fn(ctx.args, sample, dict(params))
        if not isinstance(out, Sample):
            raise TypeError(f"generate function returned {type(out).__name__}, not a Sample")
        sample = out
        _check_generated(sample)
    except Exception as e:  # a custom generate's bug fails this sample only; logged and counted
        _fail_generated(sample, e)
        return sample
    await _score(ctx, sample)
    return sample


async def _generate_group(ctx: RolloutContext, group: list[Sample], params: dict) -> list[Sample]:
    """The group's unfinished samples through ``generate_group`` (batch requests), then scored."""
    todo = [x for x in group if x.status not in _DONE]
    if todo:
        try:
            await generate_group(ctx.args, todo, dict(params))
        except Exception as e:  # a bug here must not lose the group: its samples fail, counted
            log.exception("group generate failed for samples %s", [x.index for x in todo])
            for x in todo:
                if x.status not in (*_DONE, Status.ABORTED):
                    _fail_generated(x, e)
        for x in todo:
            try:
                _check_generated(x)
            except Exception as e:
                _fail_generated(x, e)
        await asyncio.gather(*(_score(ctx, x) for x in todo))
    return group


def _check_generated(sample: Sample) -> None:
    if sample.status == Status.PENDING:
        raise ValueError("generate function left the sample's status 'pending'")
    if sample.status in (Status.COMPLETED, Status.TRUNCATED):
        check_sample(sample, f"sample {sample.index}") if sample.reward is not None else _check_shape(sample)


def _fail_generated(sample: Sample, e: Exception) -> None:
    log.warning("generate failed for sample %s: %s: %s", sample.index, type(e).__name__, e)
    try:
        _check_shape(sample)
    except ValueError:  # left half-written: keep only the prompt (and the versions it saw)
        versions = list(sample.weight_versions)
        reset_sample(sample)
        sample.weight_versions = versions
    mark_failed(sample, f"generate: {type(e).__name__}")


async def _score(ctx: RolloutContext, sample: Sample) -> None:
    if sample.status in (Status.COMPLETED, Status.TRUNCATED) and sample.reward is None and not ctx.rewarder.group_rm:
        await ctx.rewarder.score(sample)


def _check_shape(sample: Sample) -> None:
    """check_sample without the reward (not scored yet)."""
    check_sample(sample.copy(reward=0.0), f"sample {sample.index}")


async def process_group(ctx: RolloutContext, group: list[Sample], params: dict,
                        evaluation: bool) -> tuple[list[Sample], bool]:
    """Generate and score one group; returns (group, keep). Unfinished groups are never kept."""
    if ctx.generate_fn is generate and ctx.settings.sampling.rollout_request_granularity == "group":
        group = await _generate_group(ctx, group, params)
    else:  # per sample: --rollout-request-granularity sample, or a custom generate function
        group = list(await asyncio.gather(*(_generate_one(ctx, s, params) for s in group)))
    if any(s.status not in _DONE for s in group):
        return group, False
    if ctx.rewarder.group_rm:
        await ctx.rewarder.score_group([s for s in group if s.reward is None])
    if evaluation or ctx.filter_fn is None:
        return group, True
    return group, bool(ctx.filter_fn(ctx.args, group))


async def abort_requests(urls: list[str], rids: list[str] | None) -> None:
    """Abort requests ``rids`` on every engine in ``urls`` (``None``: every request)."""
    session = new_session()
    try:
        async def one(url: str) -> None:
            c = EngineClient(url, timeout=10, session=session)
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


async def run_rollout(ctx: RolloutContext, rollout_id: int, data_source: Any, evaluation: bool = False,
                      on_group: Callable[[list[Sample], bool], None] | None = None
                      ) -> tuple[list[list[Sample]], StepState, float]:
    """One rollout step (or a full pass over the eval data): returns (groups, step state, seconds).

    ``on_group(group, kept)`` is called as each group finishes (progress bars)."""
    set_context(ctx)
    step = StepState()
    set_step(step)  # the group tasks below copy this context
    ctx.active_steps.add(id(step))
    s = ctx.settings.sampling
    params = sampling_params(ctx.settings, evaluation)
    target = None if evaluation else s.rollout_batch_size
    chunk = (s.over_sampling_batch_size or s.rollout_batch_size) if not evaluation else 1 << 30
    kept: list[list[Sample]] = []
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
                group, keep = t.result()
                if keep:
                    kept.append(group)
                else:
                    step.stats.dropped_groups += 1
                    if target is not None and step.stats.dropped_groups > s.max_dropped_ratio * target:
                        raise RuntimeError(
                            f"rollout {rollout_id}: the dynamic sampling filter dropped {step.stats.dropped_groups} "
                            f"groups and kept {len(kept)}/{target} (--dynamic-sampling-max-dropped-ratio "
                            f"{s.max_dropped_ratio}); check the filter and the rewards")
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
    return kept, step, time.perf_counter() - t0


async def _wind_down(ctx: RolloutContext, step: StepState, pending: set[asyncio.Task], data_source: Any) -> None:
    """Abort what is still running; give every unfinished group back to the data source."""
    step.stopping = True
    # abort_all when this is the only step running (one request per engine), else just ours
    only_step = ctx.active_steps == {id(step)}
    await abort_requests(ctx.engine_urls(), None if only_step else list(step.inflight))
    done, still = await asyncio.wait(pending, timeout=ctx.settings.sampling.request_timeout)
    if still:
        raise RuntimeError(f"{len(still)} group(s) did not stop within {ctx.settings.sampling.request_timeout}s "
                           "of being aborted")
    for t in done:
        group, keep = t.result()
        unfinished = any(x.status not in _DONE for x in group)
        if not unfinished and not keep:
            step.stats.dropped_groups += 1
            continue
        for x in group:
            if x.status == Status.ABORTED:
                if not ctx.settings.sampling.partial_rollout:
                    reset_sample(x)
                else:
                    x.status = Status.PENDING  # resumes from its tokens next time
        data_source.add_samples([group])
        step.stats.returned_groups += 1
    pending.clear()


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
