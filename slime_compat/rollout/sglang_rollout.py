"""``slime.rollout.sglang_rollout``: ``GenerateState``, ``generate``, ``generate_and_rm(_group)``,
``generate_rollout``, ``abort``, ``get_model_url``, on top of Reservoir's rollout.

They work inside functions the rollout manager runs (a custom generate, a rollout function, or
coroutines those hand to ``slime.utils.async_utils.run``), and from a thread or event loop of a
plugin's own (slime's fully_async worker): the coroutines run on the manager's loop there
(``plugin_api.on_manager_loop``), while only the caller's loop waits:

- ``GenerateState(args)``: one per rollout manager. ``tokenizer`` (of ``--hf-checkpoint``),
  ``semaphore`` (the manager's in-flight limit: already held inside a custom generate, so taking it
  again there is free), ``sampling_params`` (the training rollout's), ``aborted`` (true once the
  step winds down), ``dp_rank_context()``, and slime's bookkeeping for hand-written rollout loops
  (``pendings``, ``remaining_batch_size``, ``submit_generate_tasks``, ``reset``).
- ``generate``: the default generate (token in, token out; retries, aborts and partial rollout as
  Reservoir's); ``generate_and_rm`` / ``generate_and_rm_group``: generate then score, with the
  custom generate and reward of the run, as slime's default rollout does per sample and per group.
- ``generate_rollout``: Reservoir's default rollout, returning ``RolloutFnTrainOutput`` /
  ``RolloutFnEvalOutput`` as slime's does (``--rollout-function-path
  slime.rollout.sglang_rollout.generate_rollout`` runs Reservoir's default rollout itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from pathlib import Path
from typing import Any, Iterator

from buffer.sample import Sample, Status
from rollout_manager.plugin_api import current_context, current_step, on_manager_loop, register_default_rollout
from slime_compat.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput

__all__ = ["GenerateState", "generate", "generate_and_rm", "generate_and_rm_group", "generate_rollout", "abort",
           "get_model_url"]
log = logging.getLogger(__name__)
_STATES: dict[int, "GenerateState"] = {}


class GenerateState:
    """The generation state slime keeps per process; here one per rollout manager (see module doc)."""

    def __new__(cls, args: Any = None) -> "GenerateState":
        ctx = current_context()
        state = _STATES.get(id(ctx))
        if state is None or state._ctx is not ctx:
            state = super().__new__(cls)
            state._setup(ctx, args if args is not None else ctx.args)
            _STATES[id(ctx)] = state
        return state

    def __init__(self, args: Any = None) -> None:
        pass  # built once, in __new__

    def _setup(self, ctx: Any, args: Any) -> None:
        from rollout_manager.generate import sampling_params
        from slime_compat.utils.processing_utils import load_tokenizer

        self._ctx, self.args = ctx, args
        self.tokenizer = ctx.tokenizer if ctx.tokenizer is not None else load_tokenizer(args.hf_checkpoint)
        self.processor = None  # text models only
        self.semaphore = ctx.semaphore
        self.sampling_params: dict[str, Any] = sampling_params(ctx.settings)
        if getattr(args, "sglang_enable_deterministic_inference", False):
            self.group_sampling_seeds = [args.rollout_seed + i for i in range(args.n_samples_per_prompt)]
        self.dp_counts = [0] * (getattr(args, "sglang_dp_size", 1) or 1)
        self.dp_rank = 0
        self._aborted = False
        self.reset()

    @property
    def aborted(self) -> bool:
        """True once ``abort`` ran or the current rollout step winds down (stop generating)."""
        step = current_step(None)
        return self._aborted or (step is not None and step.stopping)

    @aborted.setter
    def aborted(self, value: bool) -> None:
        self._aborted = bool(value)

    @contextlib.contextmanager
    def dp_rank_context(self) -> Iterator[int]:
        """The least-used data-parallel rank (for ``sglang_dp_size`` > 1 routing), for the block's duration."""
        low = min(self.dp_counts)
        rank = random.choice([i for i, c in enumerate(self.dp_counts) if c == low])
        self.dp_counts[rank] += 1
        self.dp_rank = rank
        try:
            yield rank
        finally:
            self.dp_counts[rank] -= 1

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task] = set()
        self._aborted = False

    def submit_generate_tasks(self, samples: list[list[Sample]]) -> None:
        """Start ``generate_and_rm_group`` for each group (a hand-written rollout loop's step)."""
        for group in samples:
            self.pendings.add(asyncio.ensure_future(
                generate_and_rm_group(self.args, group, sampling_params=self.sampling_params.copy(), evaluation=False)))
        self.remaining_batch_size += len(samples)


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """slime's default generate: the sample's prompt through the router, its tokens and log-probs appended."""
    return await on_manager_loop(_generate(args, sample, sampling_params))


async def _generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    from rollout_manager.generate import generate as reservoir_generate
    from rollout_manager.rollout import ensure_prompt_tokens

    if sample.status not in (Status.PENDING, Status.ABORTED):
        raise AssertionError(f"Sample status is {sample.status}")
    ensure_prompt_tokens(current_context(), sample)
    if sample.loss_mask is None:
        sample.loss_mask = [1] * sample.response_length
    sample.status = Status.PENDING
    return await reservoir_generate(args, sample, sampling_params)


async def generate_and_rm(args: Any, sample: Sample, sampling_params: dict[str, Any],
                          evaluation: bool = False) -> Sample | list[Sample]:
    """Generate ``sample`` with the run's generate function, then score it (unless ``--group-rm``)."""
    return await on_manager_loop(_generate_and_rm(args, sample, sampling_params, evaluation))


async def _generate_and_rm(args: Any, sample: Sample, sampling_params: dict[str, Any],
                           evaluation: bool) -> Sample | list[Sample]:
    from rollout_manager.rollout import generate_sample

    ctx = current_context()
    if sample.status in (Status.COMPLETED, Status.TRUNCATED):
        return sample
    if GenerateState(args).aborted:
        sample.status = Status.ABORTED
        return sample
    outs, fanout = await generate_sample(ctx, sample, sampling_params, evaluation)
    return outs if fanout else outs[0]


async def generate_and_rm_group(args: Any, group: list[Sample], sampling_params: dict[str, Any],
                                evaluation: bool = False) -> list[Sample] | list[list[Sample]]:
    """Generate and score one group (the group reward with ``--group-rm``); a fan-out sample's
    entry is its list of samples, as in slime."""
    return await on_manager_loop(_generate_and_rm_group(args, group, sampling_params, evaluation))


async def _generate_and_rm_group(args: Any, group: list[Sample], sampling_params: dict[str, Any],
                                 evaluation: bool) -> list[Sample] | list[list[Sample]]:
    import uuid

    ctx = current_context()
    state = GenerateState(args)
    if state.aborted:
        return group
    for s in group:
        if s.session_id is None:
            s.session_id = str(uuid.uuid4())
    params = [dict(sampling_params) for _ in group]
    if getattr(args, "sglang_enable_deterministic_inference", False):
        for p, seed in zip(params, state.group_sampling_seeds):
            p["sampling_seed"] = seed
    out = list(await asyncio.gather(*(_generate_and_rm(args, s, p, evaluation) for s, p in zip(group, params))))
    flat = [x for o in out for x in (o if isinstance(o, list) else [o])]
    if not state.aborted and ctx.rewarder.group_rm and all(
            x.status in (Status.COMPLETED, Status.TRUNCATED, Status.FAILED) for x in flat):
        await ctx.rewarder.score_group([x for x in flat if x.reward is None])
    return out


async def abort(args: Any, rollout_id: int) -> list[list[Sample]]:
    """Abort every request on the engines and wait for ``GenerateState.pendings``; with
    ``--partial-rollout`` the unfinished groups are returned (to give back to the data source)."""
    return await on_manager_loop(_abort(args, rollout_id))


async def _abort(args: Any, rollout_id: int) -> list[list[Sample]]:
    from rollout_manager.rollout import abort_requests

    ctx = current_context()
    state = GenerateState(args)
    state.aborted = True
    e = ctx.settings.engines
    await abort_requests(ctx.engine_urls(), None, e.admin_api_key or e.api_key)
    aborted: list[list[Sample]] = []
    while state.pendings:
        done, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
        if not getattr(args, "partial_rollout", False):
            continue
        for task in done:
            group = task.result()
            for s in group:
                if s.response and "start_rollout_id" not in s.metadata:
                    s.metadata["start_rollout_id"] = rollout_id
            aborted.append(group)
    return aborted


def get_model_url(args: Any, model_name: str, endpoint: str = "/generate") -> str:
    """The router URL (Reservoir serves one model: every name maps to the rollout's router)."""
    routers = getattr(args, "sglang_model_routers", None)
    if routers and model_name in routers:
        ip, port = routers[model_name]
        return f"http://{ip}:{port}{endpoint}"
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


# named by --rollout-function-path, the manager runs its own default rollout (no worker thread, progress per group)
@register_default_rollout
def generate_rollout(args: Any, rollout_id: int, data_source: Any,
                     evaluation: bool = False) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """Reservoir's default rollout with slime's return types (call it from a worker thread)."""
    from rollout_manager.rollout import generate_rollout as reservoir_rollout

    groups = reservoir_rollout(args, rollout_id, data_source, evaluation)
    if not evaluation:
        return RolloutFnTrainOutput(samples=groups)
    samples = [s for g in groups for s in g]
    key = getattr(args, "eval_reward_key", None) or getattr(args, "reward_key", None)
    name = Path(args.eval_prompt_data).stem if isinstance(getattr(args, "eval_prompt_data", None), str) else "eval"
    return RolloutFnEvalOutput(data={name: {
        "rewards": [(s.reward[key] if key and isinstance(s.reward, dict) else s.reward) for s in samples],
        "truncated": [s.status == Status.TRUNCATED for s in samples],
        "samples": samples}})
