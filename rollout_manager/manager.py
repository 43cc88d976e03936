"""The rollout manager: engines + router + prompt data + rollout function + rewards.

``RolloutManager`` is an asyncio object (create and use it inside one event loop); the launcher
runs it in its own process through ``RolloutManagerActor`` (a Ray async actor with the same
methods, plus ``run_async`` that keeps producing into the buffer). Plugins are loaded and the
prompt file is validated in ``__init__``, so every configuration error surfaces at start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import tempfile
from pathlib import Path
from typing import Any, Callable

from buffer.sample import Sample
from plugins.loader import load_function
from rollout_manager.data_source import DataReport, DataSource, load_prompts
from rollout_manager.dispatch import Dispatcher
from rollout_manager.engine_client import EngineClient
from rollout_manager.engines import EngineFleet
from rollout_manager.generate import (RolloutContext, SampleSlots, StepState, generate as default_generate,
                                      reset_sample, set_context)
from rollout_manager.rewards import Rewarder
from rollout_manager.rollout import abort_requests, generate_rollout as default_generate_rollout, run_rollout
from rollout_manager.router import Router
from rollout_manager.settings import RolloutSettings
from rollout_manager.summary import rollout_metrics

log = logging.getLogger(__name__)


class RolloutManager:
    """Owns the engines, the router, the prompt data, the rollout function and the rewards."""

    def __init__(self, settings: RolloutSettings, args: argparse.Namespace, log_dir: str | None = None):
        self.settings, self.args = settings, args
        p = settings.plugins
        self.rollout_fn = load_function(p.rollout_function_path, "--rollout-function-path",
                                        params=["args", "rollout_id", "data_source"])
        self.generate_fn = (load_function(p.custom_generate_function_path, "--custom-generate-function-path",
                                          params=["args", "sample", "sampling_params"], is_async=True)
                            if p.custom_generate_function_path else default_generate)
        self.filter_fn = (load_function(p.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path",
                                        params=["args", "samples"], is_async=False)
                          if p.dynamic_sampling_filter_path else None)
        self.rewarder = Rewarder(p, args)
        if not settings.hf_checkpoint:
            raise ValueError("--hf-checkpoint is required (its tokenizer encodes the prompts)")
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(settings.hf_checkpoint)
        if not settings.data.prompt_data:
            raise ValueError("--prompt-data is required")
        records, self.data_report = load_prompts(settings.data.prompt_data, settings.data, self.tokenizer)
        d = settings.data
        self.data_source = DataSource(records, settings.sampling.n_samples_per_prompt, d.rollout_shuffle,
                                      d.rollout_seed, d.num_epoch)
        self.eval_records = None
        self.eval_report: DataReport | None = None
        if settings.sampling.eval_prompt_data:
            self.eval_records, self.eval_report = load_prompts(settings.sampling.eval_prompt_data, settings.data,
                                                               self.tokenizer, flag="--eval-prompt-data")
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="reservoir-rollout-")
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        self.router: Router | None = None
        self.fleet: EngineFleet | None = None
        self.ctx: RolloutContext | None = None
        self._client: EngineClient | None = None

    # --- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Start (or attach to) the router, start and register the engines, build the context."""
        if self.ctx is not None:
            raise RuntimeError("RolloutManager.start() was already called")
        e = self.settings.engines
        if e.sglang_router_ip is not None:
            self.router = Router.attach(e.sglang_router_ip, e.sglang_router_port)
        else:
            self.router = Router.start(log_path=f"{self.log_dir}/router.log", policy=e.router_policy,
                                       health_check_interval=e.health_check_interval)
        self.fleet = EngineFleet(self.settings, self.router, self.log_dir)
        try:
            await self.fleet.start()
        except BaseException:
            self.router.stop()
            raise
        # slime's contract: custom generate/rollout functions find the router in args
        self.args.sglang_router_ip, self.args.sglang_router_port = self.router.host, self.router.port
        s = self.settings.sampling
        self._client = EngineClient(self.router.url, timeout=s.request_timeout)
        live = lambda: [eng.url for eng in self.fleet.engines if eng.registered]  # noqa: E731
        self._dispatcher = Dispatcher(self._client, live, s.rollout_dispatch == "direct", s.request_timeout)
        self.ctx = RolloutContext(
            settings=self.settings, args=self.args, client=self._client, dispatcher=self._dispatcher,
            engine_urls=lambda: self.fleet.urls,
            semaphore=SampleSlots(s.sglang_server_concurrency * len(self.fleet.engines)),
            rewarder=self.rewarder, generate_fn=self.generate_fn, filter_fn=self.filter_fn,
            loop=asyncio.get_running_loop())
        self.ctx.running.set()
        set_context(self.ctx)

    @property
    def engine_urls(self) -> list[str]:
        return self.fleet.urls if self.fleet is not None else []

    @property
    def router_url(self) -> str | None:
        return self.router.url if self.router is not None else None

    def _need_started(self) -> RolloutContext:
        if self.ctx is None:
            raise RuntimeError("RolloutManager is not started: await start() first")
        return self.ctx

    async def shutdown(self) -> None:
        """Stop the engines and the router this manager started."""
        if self.fleet is not None:
            await self.fleet.stop()
        if self.router is not None:
            self.router.stop()
        if self._client is not None:
            await self._client.close()
            await self._dispatcher.close()
        self.ctx = None

    # --- generation ----------------------------------------------------------------------
    async def _call_rollout_fn(self, rollout_id: int, data_source: Any, evaluation: bool,
                               on_group: Callable | None) -> tuple[list[list[Sample]], StepState | None, float]:
        ctx = self._need_started()
        set_context(ctx)
        if self.rollout_fn is default_generate_rollout:
            return await run_rollout(ctx, rollout_id, data_source, evaluation, on_group)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if inspect.iscoroutinefunction(self.rollout_fn):
            groups = await self.rollout_fn(self.args, rollout_id, data_source, evaluation)
        else:  # slime's rollout functions block: run them off the loop (the context travels along)
            groups = await asyncio.to_thread(self.rollout_fn, self.args, rollout_id, data_source, evaluation)
        return groups, None, loop.time() - t0

    async def generate(self, rollout_id: int, evaluation: bool = False,
                       on_group: Callable[[list[Sample], bool], None] | None = None
                       ) -> tuple[list[list[Sample]], dict[str, float]]:
        """One rollout step: ``--rollout-batch-size`` groups and their ``rollout/...`` metrics."""
        groups, step, seconds = await self._call_rollout_fn(rollout_id, self.data_source, evaluation, on_group)
        metrics = rollout_metrics(groups, step.stats if step else None, seconds, "rollout",
                                  self.settings.plugins.reward_key)
        metrics["rollout/data_skipped_lines"] = float(len(self.data_report.skipped))
        if self.fleet is not None:
            metrics["rollout/engine_restarts"] = float(sum(e.restarts for e in self.fleet.engines))
        return groups, metrics

    async def evaluate(self, rollout_id: int, on_group: Callable | None = None) -> dict[str, float]:
        """One pass over ``--eval-prompt-data``: ``eval/accuracy`` (mean reward) and friends."""
        if self.eval_records is None:
            raise RuntimeError("evaluate() needs --eval-prompt-data")
        source = DataSource(self.eval_records, self.settings.sampling.n_samples_per_eval_prompt, num_epoch=1)
        groups, step, seconds = await self._call_rollout_fn(rollout_id, source, True, on_group)
        return rollout_metrics(groups, step.stats if step else None, seconds, "eval", self.settings.plugins.reward_key)

    async def push(self, rollout_id: int, buffer_handle: Any) -> dict[str, float]:
        """Generate one step and put it into the buffer (its back-pressure makes this wait)."""
        returned = await buffer_handle.take_returned.remote(self.settings.sampling.rollout_batch_size)
        if returned:  # stale groups the buffer gave back: regenerate them under the current weights
            for g in returned:
                for s in g:
                    reset_sample(s)
            self.data_source.add_samples(returned)
        groups, metrics = await self.generate(rollout_id)
        # A sample that failed before any engine answered has no weight version, which the buffer's
        # contract requires: such groups are counted (failures by reason) and not pushed.
        unversioned = [g for g in groups if any(not s.weight_versions for s in g)]
        if unversioned:
            log.warning("rollout %d: %d group(s) with samples that never reached an engine are not pushed",
                        rollout_id, len(unversioned))
            groups = [g for g in groups if all(s.weight_versions for s in g)]
        metrics["rollout/groups_not_pushed"] = float(len(unversioned))
        import ray

        put_id = f"rollout-{rollout_id}"  # the same id on a retry: the buffer stores it once
        for attempt in range(3):
            try:
                await buffer_handle.put.remote(groups, put_id=put_id)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                # the buffer actor is restarting (it recovers from disk): retry the same put_id
                if attempt == 2:
                    raise RuntimeError(f"buffer put of rollout {rollout_id} failed 3 times: {e}") from e
                log.warning("buffer put of rollout %d failed (%s); retrying", rollout_id, e)
                await asyncio.sleep(1.0 * (attempt + 1))
        metrics["rollout/returned_stale_groups"] = float(len(returned or []))
        return metrics

    async def run_async(self, start_rollout_id: int, num_rollout: int, buffer_handle: Any,
                        on_step: Callable[[int, dict], None] | None = None) -> list[dict[str, float]]:
        """Keep producing into the buffer for rollouts ``start..start+num_rollout-1`` (async training)."""
        out = []
        for rid in range(start_rollout_id, start_rollout_id + num_rollout):
            m = await self.push(rid, buffer_handle)
            out.append(m)
            if on_step is not None:
                on_step(rid, m)
        return out

    # --- weight updates ------------------------------------------------------------------
    async def pause(self) -> None:
        """Stop sending requests and abort the running ones (they resume after ``resume``)."""
        ctx = self._need_started()
        ctx.running.clear()
        await abort_requests(self.engine_urls, None)

    async def resume(self) -> None:
        """Let generation continue (under the engines' new weights)."""
        self._need_started().running.set()

    # --- resumption ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"data_source": self.data_source.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data_source.load_state_dict(state["data_source"])
