"""The rollout manager: engines + router + prompt data + rollout function + rewards.

``RolloutManager`` is an asyncio object (create and use it inside one event loop); the launcher
runs it in its own process through ``RolloutManagerActor`` (a Ray async actor with the same
methods). Plugins are loaded and the prompt file is validated in ``__init__``, so every
configuration error surfaces at start-up.

The plugins are loaded from one table (``_PLUGIN_LOADS``: attribute, settings field, slime's
parameters, sync or async). Plugins see ``args`` with slime's attribute names filled in
(``plugins.slime_args``); what else they reach of the manager is ``plugin_api``. A rollout
function may return slime's ``RolloutFnTrainOutput`` / ``RolloutFnEvalOutput`` (their ``metrics``
join the step's). After each training rollout, samples marked ``remove_sample`` get a zero loss
mask (slime does this when it converts samples to training data), and the slime log hooks run.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import inspect
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from buffer.retry import call_buffer_async
from buffer.sample import Sample
from flags import flag_of
from metric_keys import ROLLOUT_BUFFER_CALLS_TIME, ROLLOUT_PUSH_TIME
from plugins.loader import load_function, plugin_atexit_functions
from plugins.slime_args import fill_slime_args
from rollout_manager.agent import check_agent_template, load_agent_env
from rollout_manager.autoscale import FleetAutoscaler
from rollout_manager.data_source import DataReport, DataSource, ThreadSafeDataSource, load_prompts
from rollout_manager.dispatch import Dispatcher
from rollout_manager.engines import EngineFleet
from rollout_manager.generate import SampleSlots, generate as default_generate, reset_sample
from rollout_manager.plugin_api import (DetachedWork, RolloutContext, StepState, is_default_rollout,
                                        register_live_context, run_shutdown_hooks, set_context, set_step,
                                        unregister_live_context)
from rollout_manager.rewards import Rewarder
from rollout_manager.rollout import RolloutFailed, _takes_evaluation, abort_requests, run_rollout
from rollout_manager.router import Router
from rollout_manager.settings import AGENT_GENERATE, PluginSettings, RolloutSettings
from rollout_manager.sft import conversation_check, is_sft_rollout
from rollout_manager.summary import eval_data_metrics, rollout_metrics
from rollout_manager.teacher import Teacher
from rollout_manager.tito import tito_checker
from rollout_manager.tokenizer import load_tokenizer
from sglang_protocol.client import EngineClient

log = logging.getLogger(__name__)
_SHUTDOWN_WORK_S = 5.0  # shutdown: how long detached work may take to hand back its aborted groups
_SHUTDOWN_EXIT_HOOKS_S = 4.0  # then the plugins' atexit functions (a worker thread's join)


@dataclass(frozen=True)
class _PluginLoad:
    """One plugin the manager loads at start-up, checked against slime's contract for it."""

    attr: str  # the RolloutManager attribute that holds it
    field: str  # the PluginSettings field with its import path (its flag comes from that declaration)
    params: tuple[str, ...]  # the positional arguments it is called with (slime's names)
    is_async: bool | None = None  # must be async def (True), a plain function (False), or either (None)
    unset: Callable | None = None  # what the attribute holds without a path
    same_as: str | None = None  # without a path, or with this other field's path: that field's plugin


_ROLLOUT_PARAMS = ("args", "rollout_id", "data_source")
# In the order they are loaded (the first bad one is the error a user sees). A list-valued field (a
# repeatable flag) gives a list of (path, function), in the order given.
_PLUGIN_LOADS = (
    _PluginLoad("rollout_fn", "rollout_function_path", _ROLLOUT_PARAMS),
    _PluginLoad("eval_fn", "eval_function_path", _ROLLOUT_PARAMS, same_as="rollout_function_path"),
    _PluginLoad("generate_fn", "custom_generate_function_path", ("args", "sample", "sampling_params"),
                is_async=True, unset=default_generate),
    _PluginLoad("filter_fn", "dynamic_sampling_filter_path", ("args", "samples"), is_async=False),
    _PluginLoad("sample_filter_fn", "rollout_sample_filter_path", ("args", "samples"), is_async=False),
    # slime's per-sample hooks, after generate and before the reward: sync or async, in order
    _PluginLoad("sample_hooks", "rollout_sample_hook_path", ("args", "sample")),
    _PluginLoad("all_samples_fn", "rollout_all_samples_process_path", ("args", "samples", "data_source"),
                is_async=False),
    _PluginLoad("rollout_log_fn", "custom_rollout_log_function_path",
                ("rollout_id", "args", "samples", "rollout_extra_metrics", "rollout_time"), is_async=False),
    _PluginLoad("eval_log_fn", "custom_eval_rollout_log_function_path",
                ("rollout_id", "args", "data", "extra_metrics"), is_async=False),
)


def load_plugins(p: PluginSettings) -> tuple[dict[str, Any], dict[str, str]]:
    """The plugins of ``_PLUGIN_LOADS``: ``({attribute: plugin}, {flag: import path})``, the paths
    for failure reports. Errors are ``plugins.loader``'s, naming the flag and the path."""
    plugins: dict[str, Any] = {}
    by_field: dict[str, Any] = {}
    paths: dict[str, str] = {}
    for spec in _PLUGIN_LOADS:
        flag, path = flag_of(PluginSettings, spec.field), getattr(p, spec.field)
        if isinstance(path, list):
            value: Any = [(x, load_function(x, flag, params=list(spec.params), is_async=spec.is_async)) for x in path]
        elif spec.same_as is not None and (not path or path == getattr(p, spec.same_as)):
            value, path = by_field[spec.same_as], getattr(p, spec.same_as)
        elif path:
            value = load_function(path, flag, params=list(spec.params), is_async=spec.is_async)
        else:
            value = spec.unset
        if isinstance(path, str) and path:
            paths[flag] = path
        plugins[spec.attr] = by_field[spec.field] = value
    return plugins, paths


class RolloutManager:
    """Owns the engines, the router, the prompt data, the rollout function and the rewards."""

    # the plugins (_PLUGIN_LOADS); None where not given, but the generate (the default one) and
    # the eval function (the rollout function)
    rollout_fn: Callable
    eval_fn: Callable
    generate_fn: Callable
    filter_fn: Callable | None
    sample_filter_fn: Callable | None
    sample_hooks: list[tuple[str, Callable]]
    all_samples_fn: Callable | None
    rollout_log_fn: Callable | None
    eval_log_fn: Callable | None

    def __init__(self, settings: RolloutSettings, args: argparse.Namespace, log_dir: str | None = None):
        self.settings = settings
        # the plugins' own args: a copy (the caller's namespace is never written), with slime's
        # attribute names before any plugin sees it; start() adds the router's address to it
        self.args = fill_slime_args(copy.copy(args), settings)
        p = settings.plugins
        plugins, self.paths = load_plugins(p)
        for attr, plugin in plugins.items():
            setattr(self, attr, plugin)
        if p.data_source_path:
            self.paths["--data-source-path"] = p.data_source_path
        self.rewarder = Rewarder(p, args)
        if not settings.hf_checkpoint:
            raise ValueError("--hf-checkpoint is required (its tokenizer encodes the prompts)")
        self.tokenizer = load_tokenizer(settings.hf_checkpoint)  # AutoTokenizer's, without torch where it can
        self.tito = tito_checker(settings, self.tokenizer)  # None with --tito-check off
        self.agent_env = None  # --agent-env's environment, built once (rollout_manager/agent.py)
        if p.agent_env:
            self.agent_env = load_agent_env(p.agent_env, self.args)
            check_agent_template(self.tokenizer, p.agent_env)  # refuses a template env turns cannot append to
            self.paths["--agent-env"] = p.agent_env
            if settings.data.apply_chat_template:
                log.warning("--agent-env with --apply-chat-template: sample.prompt is the templated text, which an "
                            "environment that renders the prompt itself (plugins.python_env's) takes for the user's "
                            "message; leave --apply-chat-template off for such an environment")
        elif p.custom_generate_function_path == AGENT_GENERATE:
            raise ValueError(f"--custom-generate-function-path {AGENT_GENERATE} runs an --agent-env environment: "
                             "give --agent-env")
        d = settings.data
        if p.data_source_path:  # slime's contract: the class is built with the args
            cls = load_function(p.data_source_path, "--data-source-path", params=["args"])
            try:
                self.data_source = cls(args)
            except Exception as e:
                raise ValueError(f"--data-source-path {p.data_source_path!r}: building it with (args) failed: "
                                 f"{type(e).__name__}: {e}") from e
            for method in ("get_samples", "add_samples"):
                if not callable(getattr(self.data_source, method, None)):
                    raise ValueError(f"--data-source-path {p.data_source_path!r}: the data source has no {method}()")
            self.data_report = getattr(self.data_source, "report", None) or DataReport(
                d.prompt_data or p.data_source_path, loaded=_length(self.data_source))
        else:
            if not d.prompt_data:
                raise ValueError("--prompt-data is required")
            records, self.data_report = load_prompts(d.prompt_data, d, self.tokenizer,
                                                     conversations=self._conversations(settings))
            self.data_source = DataSource(records, settings.sampling.n_samples_per_prompt, d.rollout_shuffle,
                                          d.rollout_seed, d.num_epoch)
        # rollout functions may draw from a thread of their own (slime's fully_async worker)
        self.data_source = ThreadSafeDataSource(self.data_source)
        self.eval_records = None
        self.eval_report: DataReport | None = None
        if settings.sampling.eval_prompt_data:
            self.eval_records, self.eval_report = load_prompts(settings.sampling.eval_prompt_data, settings.data,
                                                               self.tokenizer, flag="--eval-prompt-data")
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="reservoir-rollout-")
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        self.router: Router | None = None
        self.fleet: EngineFleet | None = None
        self.autoscaler: FleetAutoscaler | None = None  # --rollout-fleet-autoscale
        self.teacher: Teacher | None = None  # --opd-teacher-url / --opd-teacher-load
        self.ctx: RolloutContext | None = None
        self._client: EngineClient | None = None
        self._last_rollout_id: int | None = None
        # buffers (Ray actor ids) whose take_returned can never hand out a group (BufferCore.returns_groups)
        self._buffers_without_returns: set[str] = set()

    def _conversations(self, settings: RolloutSettings) -> Callable | None:
        """Under the SFT rollout (``rollout_manager/sft.py``) the prompt rows are whole
        conversations: their check for ``load_prompts``; None otherwise."""
        if not is_sft_rollout(self.rollout_fn):
            return None
        if settings.data.apply_chat_template:
            raise ValueError("--apply-chat-template: the SFT rollout (--rollout-function-path "
                             f"{self.paths.get('--rollout-function-path')}) renders whole conversations itself; "
                             "leave it out (slime's SFT script does)")
        if settings.sampling.eval_prompt_data and is_sft_rollout(self.eval_fn):
            raise ValueError("--eval-prompt-data: the SFT rollout does not evaluate (give an --eval-function-path "
                             "or leave --eval-prompt-data out)")
        return conversation_check(self.tokenizer, settings.data.loss_mask_type)

    # --- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Start (or attach to) the router, start and register the engines, build the context."""
        if self.ctx is not None:
            raise RuntimeError("RolloutManager.start() was already called")
        if self.engineless:
            self._start_context(client=None, dispatcher=None, engines=1)
            return
        e = self.settings.engines
        # The router first: it picks its ports (HTTP, Prometheus) with the OS's free-port choice, as the
        # engines do, so a router started while spawned engines have not bound theirs yet can take one.
        if e.sglang_router_ip is not None:
            self.router = Router.attach(e.sglang_router_ip, e.sglang_router_port)
        else:  # a process and a wait for its port: off the loop
            self.router = await asyncio.to_thread(
                Router.start, log_path=f"{self.log_dir}/router.log", policy=e.router_policy,
                health_check_interval=e.health_check_interval, extra_args=e.router_args)
        self.fleet = EngineFleet(self.settings, self.router, self.log_dir)
        try:
            await self.fleet.start()
            self.teacher = await Teacher.start(self.settings, self.log_dir)  # on-policy distillation's, if any
            if e.rollout_fleet_autoscale:
                self.autoscaler = FleetAutoscaler(self.fleet)
                await self.autoscaler.poll()  # the nodes of now are the fleet's own (rollout_manager/autoscale.py)
                self.autoscaler.start()
        except BaseException:
            await self.fleet.stop()
            self.router.stop()
            raise
        # slime's contract: custom generate/rollout functions find the router (and the engine count) in args
        self.args.sglang_router_ip, self.args.sglang_router_port = self.router.host, self.router.port
        self.args.rollout_num_engines = len(self.fleet.engines)
        s = self.settings.sampling
        self._client = EngineClient(self.router.url, timeout=s.request_timeout)
        live = lambda: [eng.url for eng in self.fleet.engines if eng.registered]  # noqa: E731
        self._dispatcher = Dispatcher(self._client, live, s.rollout_dispatch == "direct", s.request_timeout,
                                      api_key=e.api_key, admin_api_key=e.admin_api_key)
        self._start_context(self._client, self._dispatcher, len(self.fleet.engines))

    @property
    def engineless(self) -> bool:
        """The SFT rollout trains on data and evaluates nothing: no router and no engines start (what
        slime's SFT script asks with --debug-train-only), and there is nothing to push weights to."""
        return is_sft_rollout(self.rollout_fn) and is_sft_rollout(self.eval_fn)

    def _start_context(self, client: EngineClient | None, dispatcher: Dispatcher | None, engines: int) -> None:
        s = self.settings.sampling
        self.ctx = RolloutContext(
            settings=self.settings, args=self.args, client=client, dispatcher=dispatcher,
            engine_urls=lambda: self.engine_urls, semaphore=SampleSlots(s.sglang_server_concurrency * engines),
            rewarder=self.rewarder, generate_fn=self.generate_fn, filter_fn=self.filter_fn,
            loop=asyncio.get_running_loop(), tokenizer=self.tokenizer, sample_filter_fn=self.sample_filter_fn,
            all_samples_fn=self.all_samples_fn, paths=self.paths, sample_hooks=self.sample_hooks, tito=self.tito,
            agent_env=self.agent_env, detached=DetachedWork(limit=max(1, s.rollout_batch_size)), teacher=self.teacher)
        self.ctx.running.set()
        set_context(self.ctx)
        register_live_context(self.ctx)  # plugins' own threads and loops find it (plugin_api)

    @property
    def engine_urls(self) -> list[str]:
        return self.fleet.urls if self.fleet is not None else []

    @property
    def router_url(self) -> str | None:
        return self.router.url if self.router is not None else None

    def engine_restarts(self) -> dict[str, int]:
        """Per engine URL, how often the fleet started it again (a colocated run's ``EngineMemory``
        does not resume memory that a restarted engine never released)."""
        return {e.url: e.restarts for e in self.fleet.engines} if self.fleet is not None else {}

    async def add_engines(self, count: int) -> list[str]:
        """Start ``count`` more engines while the run goes on (``EngineFleet.add``); their URLs."""
        if self.fleet is None:
            raise RuntimeError("add_engines: the rollout manager has no engines (not started, or an SFT rollout)")
        urls = await self.fleet.add(count)
        self.args.rollout_num_engines = len(self.fleet.engines)  # what plugins read (slime's contract)
        return urls

    async def remove_engine(self, url: str) -> None:
        """Take one engine out of the router and end it while the run goes on (``EngineFleet.remove``)."""
        if self.fleet is None:
            raise RuntimeError("remove_engine: the rollout manager has no engines (not started, or an SFT rollout)")
        await self.fleet.remove(url)
        self.args.rollout_num_engines = len(self.fleet.engines)

    def _need_started(self) -> RolloutContext:
        if self.ctx is None:
            raise RuntimeError("RolloutManager is not started: await start() first")
        return self.ctx

    def kill(self, target: str) -> None:
        """Fault injection for the reliability tests and drills: SIGKILL the router this manager
        started (``"router"``) or engine 0 (``"engine"``); the fleet's monitor restarts either."""
        if self.fleet is None or self.router is None:
            raise RuntimeError("kill: the rollout manager has not started")
        if target == "engine":
            self.fleet.kill(0)
        elif target == "router" and self.router.process is not None:
            self.router.process.kill()
        else:
            raise ValueError(f"kill: {target!r} is not 'router' (one this manager started) or 'engine'")

    async def shutdown(self) -> None:
        """Stop the work of plugins' own threads (see ``_stop_detached_work``), then the engines and
        the router this manager started."""
        if self.ctx is not None:
            await self._stop_detached_work(self.ctx)
        if self.autoscaler is not None:  # before the fleet: it adds and removes engines
            await self.autoscaler.stop()
        stops = [self.fleet.stop()] if self.fleet is not None else []
        if self.router is not None:  # the router and the engines stop side by side (each waits on its exit)
            stops.append(asyncio.to_thread(self.router.stop))
        if self.teacher is not None:
            stops.append(self.teacher.stop())
        await asyncio.gather(*stops)
        if self._client is not None:
            await self._client.close()
            await self._dispatcher.close()
        await run_shutdown_hooks()  # plugins' on_shutdown hooks (slime's post() closes its client here)
        if self.ctx is not None:
            unregister_live_context(self.ctx)
        self.ctx = None

    async def _stop_detached_work(self, ctx: RolloutContext) -> None:
        """No new work from plugins' own threads; what runs is aborted on the engines (its groups
        come back aborted, to be handed back to the data source by the plugin) and given
        ``_SHUTDOWN_WORK_S`` to end, then cancelled; then the plugins' ``atexit`` functions run
        (slime's fully_async stops and joins its worker thread there)."""
        work = ctx.detached
        work.closed, work.step.stopping = True, True
        if work.tasks:
            e = self.settings.engines
            await abort_requests(self.engine_urls, list(work.step.inflight), e.admin_api_key or e.api_key)
            # checked again: the abort above may have ended every task (asyncio.wait refuses an empty set)
            _, still = await asyncio.wait(set(work.tasks), timeout=_SHUTDOWN_WORK_S) if work.tasks else (None, ())
            for t in still:
                t.cancel()
            if still:
                log.warning("shutdown: %d task(s) of plugins' own threads did not end within %g s; cancelled",
                            len(still), _SHUTDOWN_WORK_S)
        hooks = plugin_atexit_functions()
        if hooks:
            try:
                await asyncio.wait_for(asyncio.to_thread(_run_all, hooks), _SHUTDOWN_EXIT_HOOKS_S)
            except asyncio.TimeoutError:
                log.warning("shutdown: the plugins' atexit functions did not return within %g s",
                            _SHUTDOWN_EXIT_HOOKS_S)
        if self.data_source.num_held:
            log.info("shutdown: %d group(s) drawn by plugins' own threads were never returned (a checkpoint "
                     "saves them as given back)", self.data_source.num_held)

    # --- generation ----------------------------------------------------------------------
    async def _call_rollout_fn(self, fn: Callable, rollout_id: int, data_source: Any, evaluation: bool,
                               on_group: Callable | None) -> tuple[Any, StepState, float, dict[str, float]]:
        """Run a rollout function: (groups or slime's eval data dict, step state, seconds, its metrics)."""
        ctx = self._need_started()
        set_context(ctx)
        if is_default_rollout(fn):
            groups, step, seconds = await run_rollout(ctx, rollout_id, data_source, evaluation, on_group)
            return groups, step, seconds, _drop_metrics(step, "eval" if evaluation else "rollout")
        step = StepState(rollout_id=rollout_id)  # the default generate's counters, if the function uses it
        set_step(step)
        ctx.active_steps.add(id(step))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        kwargs = {"evaluation": evaluation} if _takes_evaluation(fn) else {}
        flag = "--eval-function-path" if evaluation else "--rollout-function-path"
        try:
            if inspect.iscoroutinefunction(fn):
                call = asyncio.ensure_future(fn(self.args, rollout_id, data_source, **kwargs))
            else:  # slime's rollout functions block: run them off the loop (the context travels along)
                call = asyncio.ensure_future(asyncio.to_thread(fn, self.args, rollout_id, data_source, **kwargs))
            out = await _unless_detached_work_fails(ctx, step, call, f"{flag} {self.paths.get(flag)!r}", rollout_id)
        except RolloutFailed:
            raise
        except Exception as e:  # one line naming the plugin; the traceback goes to the log
            log.exception("%s %s failed on rollout %d", flag, self.paths.get(flag), rollout_id)
            raise RolloutFailed(f"{flag} {self.paths.get(flag)!r} failed on rollout {rollout_id}: "
                                f"{type(e).__name__}: {e}", step) from e
        finally:
            ctx.active_steps.discard(id(step))
        data, metrics = _unpack_rollout_output(out, evaluation, flag, self.paths.get(flag))
        if isinstance(data, list) and isinstance(data_source, ThreadSafeDataSource):
            data_source.settle(data)  # groups a plugin's own thread drew are back
        if ctx.detached.failures or (isinstance(data_source, ThreadSafeDataSource) and data_source.num_held):
            metrics["rollout/held_groups"] = float(getattr(data_source, "num_held", 0))
            metrics["rollout/detached_failures"] = float(sum(ctx.detached.failures.values()))
        return data, step, loop.time() - t0, metrics

    async def generate(self, rollout_id: int, evaluation: bool = False,
                       on_group: Callable[[list[Sample], bool], None] | None = None
                       ) -> tuple[list[list[Sample]], dict[str, float]]:
        """One rollout step: ``--rollout-batch-size`` groups and their ``rollout/...`` metrics.

        Raises ``RolloutFailed`` (with ``metrics`` of what was done) when the step cannot fill its
        batch because samples keep failing or the filter keeps dropping groups."""
        self._last_rollout_id = rollout_id
        key = self.settings.plugins.reward_key
        served = await self.fleet.finished_requests() if self.fleet is not None else {}
        try:
            groups, step, seconds, extra = await self._call_rollout_fn(self.rollout_fn, rollout_id, self.data_source,
                                                                       evaluation, on_group)
        except RolloutFailed as e:
            e.metrics = rollout_metrics([], e.step.stats if e.step else None, 0.0, "rollout", key)
            raise
        if isinstance(groups, dict):
            raise RuntimeError(f"--rollout-function-path {self.paths.get('--rollout-function-path')!r} returned "
                               "evaluation data (RolloutFnEvalOutput) for a training rollout")
        for s in (s for g in groups for s in g):
            if s.remove_sample and s.loss_mask is not None:  # slime: kept, but no loss on it
                s.loss_mask = [0] * s.response_length
        metrics = rollout_metrics(groups, step.stats, seconds, "rollout", key)
        metrics.update(extra)
        metrics["rollout/data_skipped_lines"] = float(len(getattr(self.data_report, "skipped", ())))
        if self.fleet is not None:
            metrics["rollout/engine_restarts"] = float(sum(e.restarts for e in self.fleet.engines))
            # the fleet at the end of the step (it changes by add_engines / remove_engine), and the engines
            # the router sends requests to (a new engine joins it once a push gave it the current weights)
            metrics["rollout/num_engines"] = float(len(self.fleet.engines))
            metrics["rollout/engines_serving"] = float(sum(e.registered for e in self.fleet.engines))
            self.args.rollout_num_engines = len(self.fleet.engines)  # the autoscaler changes it too
            metrics.update(_engine_throughput(served, await self.fleet.finished_requests(), seconds))
        if self.rollout_log_fn is not None:
            samples = [s for g in groups for s in g]
            if self._log_hook("--custom-rollout-log-function-path", self.rollout_log_fn, rollout_id, self.args,
                              samples, extra or None, seconds):
                metrics = {}  # slime: True means the hook did the logging
        return groups, metrics

    def _log_hook(self, flag: str, fn: Callable, *args: Any) -> bool:
        try:
            return bool(fn(*args))
        except Exception as e:  # the user's logging: reported, never fatal
            log.warning("%s %s failed on rollout %s: %s: %s", flag, self.paths.get(flag), args[0], type(e).__name__, e)
            return False

    async def evaluate(self, rollout_id: int, on_group: Callable | None = None) -> dict[str, float]:
        """One pass over ``--eval-prompt-data`` (or whatever ``--eval-function-path`` evaluates):
        ``eval/accuracy`` (mean reward) and friends; slime's eval data also gives ``eval/<name>``."""
        if self.eval_records is None and is_default_rollout(self.eval_fn):
            raise RuntimeError("evaluate() needs --eval-prompt-data")
        source = (DataSource(self.eval_records, self.settings.sampling.n_samples_per_eval_prompt, num_epoch=1)
                  if self.eval_records is not None else self.data_source)
        key = self.settings.plugins.reward_key
        data, step, seconds, extra = await self._call_rollout_fn(self.eval_fn, rollout_id, source, True, on_group)
        if isinstance(data, dict):  # slime's RolloutFnEvalOutput.data
            metrics = eval_data_metrics(data, key)
            slime_data = data
        else:
            metrics = rollout_metrics(data, step.stats, seconds, "eval", key)
            slime_data = None
        metrics.update(extra)
        if self.eval_log_fn is not None:
            if slime_data is None:
                slime_data = {_eval_name(self.settings.sampling.eval_prompt_data): _slime_eval_entry(
                    [s for g in data for s in g], key)}
            if self._log_hook("--custom-eval-rollout-log-function-path", self.eval_log_fn, rollout_id, self.args,
                              slime_data, extra or None):
                metrics = {}
        return metrics

    async def push(self, rollout_id: int, buffer_handle: Any) -> dict[str, float]:
        """Generate one step and put it into the buffer (its back-pressure makes this wait)."""
        t0 = time.perf_counter()
        buffer_id = _actor_id(buffer_handle)
        returned = []
        if buffer_id is None or buffer_id not in self._buffers_without_returns:
            # retried across a buffer restart; the request id makes a retry get the same groups
            returned = await call_buffer_async(buffer_handle, "take_returned",
                                               self.settings.sampling.rollout_batch_size,
                                               request_id=f"rollout-{rollout_id}")
            if not returned and buffer_id is not None \
                    and not await call_buffer_async(buffer_handle, "returns_groups"):
                self._buffers_without_returns.add(buffer_id)  # one round trip less per push from now on
        buffer_s = time.perf_counter() - t0
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
        # the same put id on a retry across a buffer restart: the buffer stores it once
        t_put = time.perf_counter()
        await call_buffer_async(buffer_handle, "put", groups, put_id=f"rollout-{rollout_id}")
        t1 = time.perf_counter()
        metrics["rollout/returned_stale_groups"] = float(len(returned or []))
        metrics[ROLLOUT_BUFFER_CALLS_TIME.key] = buffer_s + t1 - t_put  # (the put's includes its back-pressure wait)
        metrics[ROLLOUT_PUSH_TIME.key] = t1 - t0
        return metrics

    # --- weight updates ------------------------------------------------------------------
    async def pause(self) -> None:
        """Stop sending requests and abort the running ones (they resume after ``resume``)."""
        ctx = self._need_started()
        ctx.running.clear()
        e = self.settings.engines
        await abort_requests(self.engine_urls, None, e.admin_api_key or e.api_key)

    async def resume(self) -> None:
        """Let generation continue (under the engines' new weights)."""
        self._need_started().running.set()

    # --- resumption ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The data source's position, and the groups plugins' own threads hold (drawn, not yet
        returned: they are given back to the source on resume, so no prompt is lost or drawn twice)."""
        ds = self.data_source
        held = {"held_groups": [[s.to_dict() for s in g] for g in ds.held_groups()]} if ds.num_held else {}
        if hasattr(ds, "state_dict"):
            return {"data_source": ds.state_dict(), **held}
        if hasattr(ds, "save") and self._last_rollout_id is not None:  # slime's protocol: it saves itself
            ds.save(self._last_rollout_id)
        return {"data_source": None, "data_source_rollout_id": self._last_rollout_id, **held}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (the held groups go back to the data source)."""
        ds = self.data_source
        if state.get("data_source") is not None:
            ds.load_state_dict(state["data_source"])
        elif hasattr(ds, "load"):
            ds.load(state.get("data_source_rollout_id"))
        ds.forget_held()
        held = [[Sample.from_dict(d) for d in g] for g in state.get("held_groups") or []]
        if held:
            try:
                ds.add_samples(held)
            except Exception as e:
                raise RuntimeError(f"resume: the data source cannot take back the {len(held)} group(s) a plugin's "
                                   f"own thread held at the checkpoint ({type(e).__name__}: {e}); use a data "
                                   "source with add_samples") from e


async def _unless_detached_work_fails(ctx: RolloutContext, step: StepState, call: asyncio.Future, what: str,
                                      rollout_id: int) -> Any:
    """``await call`` (a rollout function), unless the work plugins' own threads hand over keeps
    failing (``DetachedWork.failing``): then the step ends with ``RolloutFailed`` instead of waiting
    for groups that never come; the work the function's thread handed over is cancelled, so the
    thread returns (with an error naming why)."""
    failing = asyncio.ensure_future(ctx.detached.failing.wait())
    try:
        await asyncio.wait({call, failing}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        failing.cancel()
    if call.done():
        return call.result()
    work = ctx.detached
    step.failed = (f"rollout {rollout_id}: {work.in_a_row} calls in a row that a plugin's own thread handed to the "
                   f"rollout manager failed (last: {work.last_error}); {what} would wait for groups that never come")
    log.error("%s", step.failed)
    for t in list(step.handed_over):
        t.cancel()
    call.add_done_callback(lambda f: f.cancelled() or f.exception())  # its error is the one above
    raise RolloutFailed(step.failed, step)


def _engine_throughput(before: dict[int, int], after: dict[int, int], seconds: float) -> dict[str, float]:
    """``rollout/engine_<i>_samples_per_s``: the requests (samples) engine ``i`` finished during the
    step over the step's time, from its counters at the step's start and end (an engine added
    meanwhile counted from 0; one restarted meanwhile from its restart)."""
    out = {}
    for i, n in after.items():
        done = n - before.get(i, 0) if n >= before.get(i, 0) else n
        out[f"rollout/engine_{i}_samples_per_s"] = done / seconds if seconds > 0 else 0.0
    return out


def _run_all(fns: list[Callable[[], Any]]) -> None:
    for fn in fns:
        try:
            fn()
        except Exception:  # noqa: BLE001 - one plugin's cleanup must not skip the others'
            log.exception("plugin atexit function %s.%s failed", getattr(fn, "__module__", "?"),
                          getattr(fn, "__qualname__", repr(fn)))


def _actor_id(handle: Any) -> str | None:
    """A Ray actor handle's actor id (the same for every copy of the handle); None for another object."""
    actor_id = getattr(handle, "_actor_id", None)
    return actor_id.hex() if hasattr(actor_id, "hex") else None


def _length(ds: Any) -> int:
    try:
        return len(ds)
    except TypeError:
        return 0


def _drop_metrics(step: StepState, prefix: str) -> dict[str, float]:
    """slime's ``rollout/dynamic_filter/drop_<reason>`` counts."""
    return {f"{prefix}/dynamic_filter/drop_{r}": float(n) for r, n in step.stats.drop_reasons.items()}


def _as_groups(samples: Any, where: str) -> list[list[Sample]]:
    """A rollout function's samples as groups: a list of groups (a group may be slime's fan-out
    form, a list of lists, which becomes one group), or a flat list of samples (grouped by
    ``group_index``, in order)."""
    if not isinstance(samples, list):
        raise TypeError(f"{where} returned {type(samples).__name__}, expected a list of groups of Samples")
    if all(isinstance(x, Sample) for x in samples):
        groups: list[list[Sample]] = []
        for x in samples:
            if groups and groups[-1][0].group_index == x.group_index and x.group_index is not None:
                groups[-1].append(x)
            else:
                groups.append([x])
        return groups
    out = []
    for i, g in enumerate(samples):
        if not isinstance(g, list) or not g:
            raise TypeError(f"{where} returned a group {i} that is {type(g).__name__}, not a non-empty list")
        flat: list[Sample] = []
        for part in g:
            if isinstance(part, list):  # a fan-out: one rollout execution's samples
                for x in part:
                    if x.rollout_id is None:
                        x.rollout_id = part[0].index
                flat += part
            else:
                flat.append(part)
        if not all(isinstance(x, Sample) for x in flat):
            raise TypeError(f"{where} returned a group {i} holding {sorted({type(x).__name__ for x in flat})}")
        out.append(flat)
    return out


def _unpack_rollout_output(out: Any, evaluation: bool, flag: str, path: str | None
                           ) -> tuple[Any, dict[str, float]]:
    """(groups, or slime's eval data dict; metrics) from a plain list or slime's output types
    (read by their fields, so slime's own classes work as well as ``slime_compat``'s)."""
    where = f"{flag} {path!r}"
    metrics = {}
    if hasattr(out, "samples"):  # RolloutFnTrainOutput
        metrics, out = dict(getattr(out, "metrics", None) or {}), out.samples
    elif hasattr(out, "data") and isinstance(getattr(out, "data"), dict):  # RolloutFnEvalOutput
        metrics = dict(getattr(out, "metrics", None) or {})
        return out.data, _numbers(metrics)
    elif evaluation and isinstance(out, dict):  # slime's legacy eval return: the data dict itself
        return out, {}
    return _as_groups(out, where), _numbers(metrics)


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _eval_name(path: str | None) -> str:
    return Path(path).stem if path else "eval"


def _slime_eval_entry(samples: list[Sample], key: str | None) -> dict[str, Any]:
    from buffer.sample import Status

    return {"rewards": [s.reward[key] if key and isinstance(s.reward, dict) else s.reward for s in samples],
            "truncated": [s.status == Status.TRUNCATED for s in samples], "samples": samples}
