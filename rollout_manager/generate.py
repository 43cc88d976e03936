"""The default generate: per sample (slime's ``async generate(args, sample, sampling_params)``) and
per group (``generate_group``: a prompt's samples in one batch ``/generate``, the default rollout's
way unless ``--rollout-request-granularity sample``).

Token in, token out: the sample's ``tokens`` (prompt, plus anything generated before a partial
rollout was interrupted) go to ``/generate`` as ``input_ids``; the answer's ``output_ids`` and the
log-probs in ``meta_info.output_token_logprobs`` are appended, never re-tokenized. Each segment is
tagged with the ``meta_info.weight_version`` the engine reported.

The manager's state that a generate function needs (the router client, the concurrency limit,
pause/stop signals) is reached through ``current_context()`` / ``current_step()`` of the public
plugin API (``plugin_api.py``): context variables set by the rollout loop, so custom generate
functions keep slime's signature.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from buffer.sample import CORRECT, Sample, Status, parse_weight_version  # noqa: F401 (re-exported for plugins)
from buffer.agent_turns import AGENT_STATE, AGENT_TURNS
from rollout_manager.plugin_api import RolloutContext, RolloutStats, current_context, current_step
from rollout_manager.rewards import mark_failed
from rollout_manager.settings import RolloutSettings
from rollout_manager.tito import CHAT_TURNS, ENGINE_SPANS, record_engine_span
from sglang_protocol.client import EngineError, batch_rids


class SampleSlots(asyncio.Semaphore):
    """The in-flight limit, counted in samples: ``acquire_many(k)`` takes ``k`` slots at once for a
    group request of ``k`` samples; ``async with`` holds one slot for a whole block of work.

    ``async with`` is what the rollout wraps around each custom generate call (slime's
    ``generate_and_rm`` holds its semaphore the same way): inside it, and in the tasks it starts,
    the slot is *held*, and further ``async with`` / ``acquire_many`` / ``release_many`` on the same
    slots are no-ops, so a custom generate that calls the default ``generate`` or takes the
    semaphore itself never waits on its own slot. Multi-slot takers queue on a lock, so two groups
    each holding part of what they need can never wait on each other forever; ``k`` must not exceed
    ``capacity`` (callers split)."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.capacity = capacity
        self._many = asyncio.Lock()

    def held(self) -> bool:
        """Whether this task (or the task that started it) holds a slot through ``async with``."""
        v = _HELD.get()
        return v is not None and v[0] is self

    async def __aenter__(self) -> None:
        v = _HELD.get()
        if v is not None and v[0] is self:
            _HELD.set((self, v[1] + 1))
            return None
        await self.acquire()
        _HELD.set((self, 1))
        return None

    async def __aexit__(self, *exc: Any) -> None:
        v = _HELD.get()
        if v is not None and v[0] is self and v[1] > 1:
            _HELD.set((self, v[1] - 1))
            return
        _HELD.set(None)
        self.release()

    async def acquire_many(self, k: int) -> None:
        if self.held():
            return
        if not 1 <= k <= self.capacity:
            raise ValueError(f"cannot take {k} of {self.capacity} in-flight slots")
        if k == 1:
            await self.acquire()
            return
        got = 0
        async with self._many:
            try:
                for _ in range(k):
                    await self.acquire()
                    got += 1
            except BaseException:  # cancelled while waiting: give back what was taken
                for _ in range(got):
                    self.release()
                raise

    def release_many(self, k: int) -> None:
        if self.held():
            return
        for _ in range(k):
            self.release()


log = logging.getLogger(__name__)
MAX_IDLE_ABORTS = 50  # engine-side aborts in a row without progress before a sample fails (~3 min)
_HELD: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("reservoir_slots_held", default=None)


def sampling_params(settings: RolloutSettings, evaluation: bool = False) -> dict[str, Any]:
    """SGLang ``sampling_params`` for training rollouts or evaluation."""
    s = settings.sampling
    temperature = s.eval_temperature if evaluation else s.rollout_temperature
    max_len = (s.eval_max_response_len or s.rollout_max_response_len) if evaluation else s.rollout_max_response_len
    return {"temperature": temperature, "top_p": s.rollout_top_p, "top_k": s.rollout_top_k,
            "max_new_tokens": max_len, "stop": list(s.rollout_stop), "stop_token_ids": list(s.rollout_stop_token_ids),
            "skip_special_tokens": s.rollout_skip_special_tokens, "no_stop_trim": True}


def reset_sample(sample: Sample) -> None:
    """Drop everything generated so far (the sample restarts from its prompt)."""
    prompt_len = sample.prompt_length
    sample.tokens = sample.tokens[:prompt_len]
    sample.response, sample.response_length = "", 0
    sample.loss_mask, sample.rollout_log_probs = [], []
    sample.weight_versions, sample.reward, sample.status = [], None, Status.PENDING
    sample.metadata.pop("failure_reason", None)
    sample.metadata.pop(ENGINE_SPANS, None)
    sample.metadata.pop(CHAT_TURNS, None)
    sample.metadata.pop(AGENT_TURNS, None)  # an agent episode starts afresh (rollout_manager/agent.py)
    sample.metadata.pop(AGENT_STATE, None)
    sample.metadata.pop(CORRECT, None)  # whether the answer was right: the new answer's to say


def append_segment(sample: Sample, out: dict, mask_offpolicy: bool) -> int:
    """Append one ``/generate`` answer to ``sample``; returns the number of new tokens."""
    meta = out["meta_info"]
    ids = list(out["output_ids"])
    logps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
    if len(logps) != len(ids):
        raise RuntimeError(f"engine returned {len(ids)} output_ids but {len(logps)} output_token_logprobs")
    version = parse_weight_version(meta.get("weight_version"))
    aborted = (meta.get("finish_reason") or {}).get("type") == "abort"
    # an empty aborted segment produced nothing: it must not tag the sample with its version
    if ids or (not sample.weight_versions and not aborted):
        if mask_offpolicy and sample.weight_versions and version != sample.weight_versions[-1]:
            # the tokens so far came from an older policy: keep them as context, not as loss
            sample.loss_mask = [0] * sample.response_length
        sample.weight_versions.append(version)
    start = len(sample.tokens)
    sample.tokens += ids
    sample.response += out.get("text") or ""
    sample.response_length += len(ids)
    sample.loss_mask = (sample.loss_mask or []) + [1] * len(ids)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + logps
    record_engine_span(sample, start, ids, meta)  # what --tito-check checks the sample against
    return len(ids)


async def generate(args: argparse.Namespace, sample: Sample, sampling_params: dict) -> Sample:
    """Generate (or resume) one sample through the router; retries engine failures on other engines.

    A group of one for ``generate_group`` (one plain ``/generate`` per request): the per-sample and
    group paths share every rule (retries, aborts, partial rollout, failures)."""
    await generate_group(args, [sample], sampling_params)
    return sample


# --- group requests ------------------------------------------------------------------------------
def request_params(sample: Sample, sampling_params: dict) -> dict:
    """The sampling params of ``sample``'s next request: the shared ones with its remaining budget."""
    return {**sampling_params, "max_new_tokens": sampling_params["max_new_tokens"] - sample.response_length}


def split_requests(samples: list[Sample], sampling_params: dict, limit: int) -> list[tuple[dict, list[Sample]]]:
    """Which samples can share one batch ``/generate``: ``[(params, samples)]``, in first-seen order.

    A batch carries ONE ``sampling_params`` dict (the only form sglang-router 0.3.2 forwards), so
    only samples whose next request has identical params share one: fresh samples of a group do;
    partial-rollout resumes with different remaining budgets split by budget. A sample whose params
    carry a ``sampling_seed`` always goes alone: the seed is meant for that one sample, and a shared
    seed would draw the same tokens for every element of the batch. At most ``limit`` samples (the
    in-flight limit) per request."""
    out: list[tuple[dict, list[Sample]]] = []
    by_key: dict[tuple, list[Sample]] = {}
    for sample in samples:
        p = request_params(sample, sampling_params)
        if p.get("sampling_seed") is not None:
            out.append((p, [sample]))  # never batched (see above)
            continue
        key = tuple(sorted((k, repr(v)) for k, v in p.items()))
        batch = by_key.get(key)
        if batch is None or len(batch) >= limit:
            batch = by_key[key] = []
            out.append((p, batch))
        batch.append(sample)
    return out


def _time_request(stats: RolloutStats, seconds: float, outs: list) -> None:
    """Record one answered request's time as the manager saw it and as the engine reports it."""
    engine = [o["meta_info"]["e2e_latency"] for o in outs if isinstance(o, dict) and isinstance(
        o.get("meta_info"), dict) and isinstance(o["meta_info"].get("e2e_latency"), (int, float))]
    # every element says (SGLang and the embedded engines do), else the engine's time is unknown
    stats.request_times.append((seconds, max(engine) if engine and len(engine) == len(outs) else None))


@dataclass
class _GroupRetry:
    """Retry state shared by a group's requests."""

    attempt: int = 0
    avoid: set[str] = field(default_factory=set)  # engines that failed this group
    idle_aborts: dict[int, int] = field(default_factory=dict)  # id(sample) -> aborts in a row with no tokens


async def generate_group(args: argparse.Namespace, samples: list[Sample], sampling_params: dict) -> list[Sample]:
    """Generate (or resume) ``samples`` (one group's unfinished ones) with batch requests.

    Each sample ends COMPLETED or TRUNCATED with its segments appended (``append_segment``: output
    ids, log-probs, weight versions), ABORTED when its step stops, or FAILED (counted, with a reason:
    the engine rejected the request, stayed unreachable after ``--rollout-max-retries``, answered
    malformed, or aborted it with no progress too often); an abort midway (a weight update's pause)
    resumes from the tokens so far. One request per set of samples that can share it
    (``split_requests``); a request that fails on an engine is retried whole on another: no sample
    gets a segment twice or is lost. Each element is aborted on its own by its rid (``batch_rids``),
    as partial rollout does."""
    ctx = current_context()
    retry = _GroupRetry()
    todo = list(samples)
    while todo:
        for sample in [x for x in todo if request_params(x, sampling_params)["max_new_tokens"] <= 0]:
            sample.status = Status.TRUNCATED
            todo.remove(sample)
        if not todo:
            break
        parts = split_requests(todo, sampling_params, ctx.semaphore.capacity)
        rounds = await asyncio.gather(*(_group_request(ctx, batch, p, retry) for p, batch in parts))
        todo = [x for r in rounds for x in r]
    return samples


async def _group_request(ctx: RolloutContext, batch: list[Sample], params: dict, retry: _GroupRetry) -> list[Sample]:
    """One request for ``batch``; returns the samples that need another request (aborted midway,
    or the request failed and is retried); the others end with a final status."""
    step, s = current_step(), ctx.settings.sampling
    k = len(batch)
    if not ctx.running.is_set():  # paused for a weight update: wait, then continue
        if step.stopping:
            return _end(batch, Status.ABORTED)
        await ctx.running.wait()
    await ctx.semaphore.acquire_many(k)
    try:
        if step.stopping:
            return _end(batch, Status.ABORTED)
        if not ctx.running.is_set():
            return batch
        rid = uuid.uuid4().hex
        rids = batch_rids(rid, k) if k > 1 else [rid]
        step.inflight.update(rids)
        step.stats.requests += 1
        url, client = ctx.dispatcher.pick(retry.avoid)
        ctx.dispatcher.started(url, k)
        lora = {"lora_path": s.lora_path} if s.lora_path else {}  # --lora-rank: the policy's adapter
        sent = time.perf_counter()
        try:
            if k > 1:
                outs = await client.generate_batch([x.tokens for x in batch], sampling_params=params,
                                                   return_logprob=True, rid=rid, timeout=s.request_timeout, **lora)
            else:  # one sample: the plain form (no list to build or check)
                outs = [await client.generate(input_ids=batch[0].tokens, sampling_params=params,
                                              return_logprob=True, rid=rid, timeout=s.request_timeout, **lora)]
        except EngineError as e:
            outs = None
            retry.avoid.add(url)
            if e.status is not None and 400 <= e.status < 500:
                log.warning("samples %s: engine rejected the request: %s", [x.index for x in batch], e)
                for x in batch:  # our request is bad: retrying won't help
                    mark_failed(x, f"engine: HTTP {e.status}")
                return []
            retry.attempt += 1
            step.stats.retries += 1
            if retry.attempt > s.max_request_retries:
                for x in batch:
                    mark_failed(x, "engine: unreachable")
                return []
        finally:
            step.inflight.difference_update(rids)
            ctx.dispatcher.finished(url, k)
    finally:
        ctx.semaphore.release_many(k)
    if outs is None:  # back off outside the slots; the health monitor removes dead engines meanwhile
        await asyncio.sleep(min(0.25 * 2 ** (retry.attempt - 1), 4.0))
        return batch
    _time_request(step.stats, time.perf_counter() - sent, outs)
    again: list[Sample] = []
    idle = 0
    for sample, out in zip(batch, outs):
        try:
            new_tokens = append_segment(sample, out, s.mask_offpolicy_in_partial_rollout)
            step.stats.generated_tokens += new_tokens
        except (RuntimeError, KeyError, TypeError, ValueError) as e:  # a malformed element fails its sample only
            mark_failed(sample, f"engine: {e}"[:80])
            continue
        finish = (out["meta_info"].get("finish_reason") or {}).get("type")
        if finish != "abort":
            sample.status = Status.TRUNCATED if finish == "length" else Status.COMPLETED
            continue
        step.stats.aborted_requests += 1  # counted per sample (a group request counts each element)
        if not s.partial_rollout:
            reset_sample(sample)  # without partial rollout, an interrupted response restarts
        if step.stopping:
            sample.status = Status.ABORTED
            continue
        if new_tokens:
            retry.idle_aborts[id(sample)] = 0  # progress (e.g. weight_sync paused the engines mid-request)
        elif ctx.running.is_set():
            # nothing generated and not our pause: an engine-side pause while queued, or an engine that
            # aborts this request every time; the second must not loop forever (as in generate)
            n = retry.idle_aborts[id(sample)] = retry.idle_aborts.get(id(sample), 0) + 1
            if n > MAX_IDLE_ABORTS:
                mark_failed(sample, "engine: aborted")
                continue
            idle = max(idle, n)
        again.append(sample)
    if idle:
        await asyncio.sleep(min(0.25 * 2 ** (idle - 1), 4.0))
    return again


def _end(batch: list[Sample], status: Status) -> list[Sample]:
    for x in batch:
        x.status = status
    return []
