"""The parts of a run, built once from the parsed flags (start-up and wiring), and each step of
the schedule as one named method. ``scripts/train.py`` reads the schedule; this module does the
wiring. The driver's checkpoint (what a save writes, what ``--load`` reads back) lives in
``checkpoint.py``; fault injection for the reliability tests in ``faults.py``, whose crash points
mark the ends of the step methods here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from scripts import checkpoint
from scripts.arguments import RunSettings, check_inputs
from scripts.faults import crash_point_after, die_in_push
from scripts.metrics_log import MetricsLogger, duration, eval_line, missing_plots, plot_metrics, read_metrics
from scripts.producer import AsyncProducer

from buffer.retry import PendingGet, call_buffer
from metric_keys import (EVAL_ACCURACY, ROLLOUT_REWARD_MEAN, ROLLOUT_TIME, STEP_TIME, TRAIN_TIME, WEIGHT_SYNC_TIME,
                         step_breakdown)

_GET_POLL_S = 10.0  # async mode: how long one buffer wait lasts before the producer is checked


class Run:
    """Everything one training run holds: Ray, the buffer, the rollout manager, the trainer
    ranks (a Ray actor group; rank 0 owns the weight sender), the metrics log, and the step to
    start from."""

    def __init__(self, args: argparse.Namespace, settings: RunSettings):
        self.args = args  # only for plugins (their ``args``); everything else reads ``settings``
        self.settings = settings
        self.s = settings.launcher
        self.output_dir = Path(self.s.output_dir)
        self.start_step = 0
        self.buffer = self.rollout = self.trainer = None
        self.weight_sync_connected = False
        self.engine_memory = None  # --colocate, --offload-rollout: the engines' GPU memory to the trainer and back
        self._pending: dict[str, float] = {}
        self._commit_at: int | None = None  # no --save: the step whose consumption log_step makes final
        self._fleet_urls = None  # the rollout manager's engine_urls, asked for by train (an ObjectRef)
        self._producer: AsyncProducer | None = None
        self.first_rollout = 0  # the next rollout to generate (after a resume: the first the checkpoint lacks)
        self._owns_ray = False
        self.max_staleness = settings.buffer.max_weight_staleness or 0
        self.is_async = self.max_staleness > 0 and not (self.s.debug_rollout_only or self.s.debug_train_only)
        self._started = time.monotonic()  # for the closing summary's wall times
        self._loop_started: float | None = None
        self._bar = None  # the progress bar (``progress``)
        self._last_eval: tuple[int, float] | None = None
        self._plots: list[Path] = []
        self.steps_done = 0

    # --- start-up ------------------------------------------------------------------------
    @classmethod
    def start(cls, args: argparse.Namespace, settings: RunSettings) -> "Run":
        """Build the run: Ray, buffer, rollout manager, trainer ranks; then resume (``--load``) and connect weight sync.

        The rollout side and the trainer start side by side (one after the other with ``--colocate``). Raises
        ValueError for a bad setting found while starting a part (``arguments.parse`` checked the input
        files); the output directory gets its metrics, events and wandb run only once every part started.
        """
        run = cls(args, settings)
        run._maybe_build_toy_model()
        run._seed(settings.train.seed)
        run._start_ray()
        parts = [start for start, wanted in ((run._start_rollout_side, not run.s.debug_train_only),
                                             (run._start_trainer, not run.s.debug_rollout_only)) if wanted]
        if run.s.colocate:  # the engines release their GPU memory before the trainer builds its model
            for start in parts:
                start()
        else:  # the engines load their model while the trainer ranks build theirs
            _side_by_side(parts)
        run.logger = MetricsLogger(run.output_dir, run.s.use_tensorboard, run.s.use_wandb, run.s.wandb_project,
                                   # the flags as the user gave them (slime's names), for the run's record
                                   run_config={k: v for k, v in vars(args).items() if _is_plain(v) and k != "wandb_key"},
                                   wandb_group=run.s.wandb_group, wandb_key=run.s.wandb_key)
        if run.s.load:
            run.start_step, run.first_rollout = checkpoint.resume(run.s.load, trainer=run.trainer,
                                                                  rollout=run.rollout, buffer=run.buffer,
                                                                  logger=run.logger)
        if run.trainer is not None and run.rollout is not None and run.engine_urls:  # none: the SFT rollout's
            run._connect_weight_sync()
        return run

    def _toy_model_to_build(self) -> Path | None:
        ckpt = Path(self.settings.train.hf_checkpoint)
        return ckpt if self.s.build_toy_model and not (ckpt / "config.json").exists() else None

    def _maybe_build_toy_model(self) -> None:
        ckpt = self._toy_model_to_build()
        if ckpt is not None:
            from scripts import make_toy_model

            print(f"building the toy model at {ckpt} (--build-toy-model)")
            make_toy_model.main(["--out", str(ckpt), "--warmup-steps", str(self.s.toy_warmup_steps)])
            check_inputs(self.settings)  # what lies inside it (the toy prompts): parse could not check it yet

    def _seed(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        if "torch" in sys.modules:  # the launcher draws no torch random numbers, and importing torch
            sys.modules["torch"].manual_seed(seed)  # for the seed alone was most of its start-up CPU

    def _start_ray(self) -> None:
        """Every mode needs Ray: the trainer ranks are actors too (--debug-train-only included)."""
        token_auth_to_join(self.s.ray_address)  # before Ray is imported (start_ray's doc)
        import ray

        if not ray.is_initialized():
            self._owns_ray = True
            start_ray(self.s.ray_address)

    def _start_rollout_side(self) -> None:
        import ray

        from buffer import create_buffer
        from buffer.interfaces import NAMESPACE
        from rollout_manager.actor import create_rollout_manager_actor

        bs = self.settings.buffer
        if bs.persist_dir is None and self.s.save:
            bs = dataclasses.replace(bs, persist_dir=str(Path(self.s.save) / "buffer"))
        self.buffer = create_buffer(self.s.buffer_name, bs, plugin_args=self.args)
        # (the rollout manager makes the logs directory once its plugins and prompts loaded)
        # On this node: it writes the engine logs and events into --output-dir, which is this node's
        # disk; its router listens on loopback; with --colocate its engines are local subprocesses,
        # beside the trainer ranks. (Engines placed by Ray run where their bundles are.)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        here = {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                      soft=False)}
        rs = self.settings.rollout
        rs = dataclasses.replace(rs, engines=dataclasses.replace(rs.engines, **self._weight_update_access()))
        # named, so that an operator's driver can reach its admin calls (add_engines, remove_engine)
        self.rollout = create_rollout_manager_actor(rs, self.args, str((self.output_dir / "logs").resolve()),
                                                    name=f"{self.s.buffer_name}-rollout", namespace=NAMESPACE, **here)
        self.engine_urls = ray.get(self.rollout.start.remote())
        if self.s.offload_rollout and not self.s.debug_rollout_only and self.engine_urls:
            from weight_sync.engines import EngineMemory

            rollout = self.rollout
            self.engine_memory = EngineMemory(self.engine_urls, self._sync_settings,
                                              restarts=lambda: ray.get(rollout.engine_restarts.remote()))
            self.engine_memory.release()  # before the trainer builds its model; back once the weights are in

    def _weight_update_access(self) -> dict[str, list[str]]:
        """What embedded engines let this run's pushes use (docs/security.md): the disk transport's
        directory, and the trainer's rendezvous address when it is not loopback. (Engines on other
        hosts need ``--update-weight-master-address`` set to the trainer's node: the address rank 0
        would pick itself is not known here.)"""
        dirs = [str(Path(d).resolve()) for d in [self.settings.sync.disk_dir] if d]
        master = self.settings.sync.master_address
        return {"weight_update_dirs": dirs,
                "weight_update_masters": [] if master in ("127.0.0.1", "localhost", "::1") else [master]}

    def _start_trainer(self) -> None:
        """The trainer ranks (--actor-num-nodes x --actor-num-gpus-per-node), one Ray actor each;
        one rank is the same code path."""
        from train_backend.actor_group import TrainerGroup

        s = self.settings
        self.trainer = TrainerGroup(s.train, s.megatron, s.group)
        print("trainer ranks: " + ", ".join(f"{p['rank']}@{p['node']}" + (f" gpu {p['gpus']}" if p["gpus"] else "")
                                            for p in self.trainer.placement()), flush=True)

    @functools.cached_property
    def _sync_settings(self):
        """weight_sync's settings, with what the rollout side knows: the engines' API keys and, for
        SGLang engines started here, the dtype they serve in (pushes cast floating tensors to it).
        Built once (it reads the model's config)."""
        from weight_sync.arguments import sglang_serving_dtype

        e = self.settings.rollout.engines
        dtype = sglang_serving_dtype(e.sglang_args, self.settings.train.hf_checkpoint) \
            if e.rollout_engine == "sglang" and not e.engine_urls else None
        # the fleet restarts the engines it started: a push that finds none live waits for one
        wait = e.engine_startup_timeout if e.restart_dead_engines and not e.engine_urls else 0.0
        return dataclasses.replace(self.settings.sync, api_key=e.api_key, admin_api_key=e.admin_api_key,
                                   engine_dtype=dtype, engine_wait_s=wait)

    def _connect_weight_sync(self) -> None:
        from rollout_manager.engines import engine_gpus

        # each engine joins the weight-update group with one rank per GPU (SGLang: rank_offset + tp_rank)
        gpus = asyncio.run(engine_gpus(self.settings.rollout, self.engine_urls))
        sync = self._sync_settings
        print(f"weight sync: {sync.transport}" + (f" over {sync.backend}" if sync.transport == "distributed" else "")
              + (f", floating tensors cast to {sync.engine_dtype}" if sync.engine_dtype else ""), flush=True)
        # rank 0 records each pushed version in the buffer (its actor handle travels to the rank)
        self.trainer.connect_weight_sync(sync, self.engine_urls, gpus, self.buffer)
        self.weight_sync_connected = True
        if self.start_step > 0:  # resumed: the engines still serve the initial checkpoint
            self._push_weights(self.start_step)
        if self.engine_memory is not None:  # the engines serve the trainer's weights: they generate again
            self.engine_memory.resume()

    # --- the schedule's steps --------------------------------------------------------------
    def progress(self, steps: Iterable[int]):
        """A tqdm progress bar over ``steps``, starting at ``start_step`` of ``--num-rollout``: steps
        done of all, and (``log_step``) the last step's rollout reward and the last eval accuracy."""
        from tqdm import tqdm

        self._loop_started = time.monotonic()
        self._bar = tqdm(steps, desc="rollout steps" if self.s.debug_rollout_only else "training steps", unit="step",
                         initial=self.start_step, total=self.s.num_rollout, dynamic_ncols=True)
        return self._bar

    def start_async_rollout(self) -> None:
        """Async mode: the rollout manager produces into the buffer, at most K steps ahead of
        the trainer, until ``finish`` stops it (groups dropped as stale are made up for)."""
        self._producer = AsyncProducer(self.rollout, self.buffer, self.first_rollout, 1 << 40, self.max_staleness)

    def generate(self, step: int) -> None:
        """Sync mode: put this step's groups into the buffer.

        The put is tagged ``rollout-{step}``: after a resume, the step that was in flight at the
        crash is generated again from the checkpointed data position, and the buffer stores it
        only if the first attempt never reached it. So the data position stays exact too.
        """
        import ray

        if self.rollout is None:  # --debug-train-only: batches come from files
            return
        with self._timer(ROLLOUT_TIME.key):
            self._pending.update(ray.get(self.rollout.push.remote(step, self.buffer)))

    @crash_point_after("after_get")
    def get_batch(self, step: int) -> list[list[Any]] | PendingGet:
        """Take this step's groups: from the buffer, or from a debug dump (--debug-train-only).

        In sync mode, when nothing here reads the groups, the buffer's answer goes to trainer rank 0
        unopened (a :class:`~buffer.retry.PendingGet`): the batch skips the driver's unpickling and
        pickling again, rank 0 fetches it, and a failed get fails the train call with the buffer's
        error (``train_backend.actor_group.TrainerRank.train_step``)."""
        from buffer.arrow import read_parquet, write_parquet

        n = self.settings.rollout.sampling.rollout_batch_size
        if self.trainer is not None and not (self.max_staleness or self.s.debug_train_only
                                             or self.s.save_debug_rollout_data):
            return PendingGet(self.buffer, n, step)  # rank 0 reports the wait as perf/buffer_wait_time
        with self._timer("perf/buffer_wait_time"):
            if self.s.debug_train_only:
                groups = read_parquet(self.s.load_debug_rollout_data.format(rollout_id=step))
            elif self._producer is None:
                groups = call_buffer(self.buffer, "get", n, step=step)
            else:  # waits in slices, so a failed producer is reported instead of waited on
                groups = self._get_async(step)
        if self.s.save_debug_rollout_data:
            write_parquet(groups, self.s.save_debug_rollout_data.format(rollout_id=step))
        if self.max_staleness or self.is_async:
            lags = [step - min(s.weight_versions) for g in groups for s in g]
            self._pending["perf/staleness_max"] = float(max(lags))
        return groups

    @crash_point_after("after_train")
    def train(self, step: int, groups: list[list[Any]] | PendingGet) -> None:
        """Train on this step's groups; their metrics wait for ``log_step`` (no-op with ``--debug-rollout-only``).

        With ``--colocate`` the engines first release their GPU memory to the trainer.
        """
        if self.trainer is None:  # --debug-rollout-only
            return
        if self.engine_memory is not None:  # --colocate (--offload-rollout): the engines' KV cache goes to the trainer
            with self._timer("perf/release_memory_time"):
                self.engine_memory.release()
        if self.weight_sync_connected and not self.s.colocate:
            # the fleet's URLs for the push that follows, asked for now: the answer travels while the
            # ranks train instead of costing the push a round trip of its own. An engine added
            # meanwhile gets the next push (the fleet admits engines only at its weight version)
            self._fleet_urls = self.rollout.engine_urls.remote()
        with self._timer(TRAIN_TIME.key):
            self._pending.update(self.trainer.train_step(groups, step))

    @crash_point_after("after_push", step_of=lambda version: version - 1)
    def update_weights(self, version: int) -> None:
        """Push the trainer's weights to every engine; the buffer's version becomes ``version``."""
        self._push_weights(version)

    def _push_weights(self, version: int) -> None:
        if not self.weight_sync_connected:
            return
        self._follow_fleet()
        with self._timer(WEIGHT_SYNC_TIME.key):
            metrics = self.trainer.push_weights(version, die_in_push(version - 1))
        self._pending.update({k if "/" in k else f"weight_sync/{k}": v for k, v in metrics.items()})
        if self.engine_memory is not None:  # --colocate: the new weights are in; the KV cache comes back
            with self._timer("perf/resume_memory_time"):
                self.engine_memory.resume()

    def _follow_fleet(self) -> None:
        """Engines added or removed since the last push (``add_engines`` / ``remove_engine`` on the
        rollout manager): the push goes to the fleet of now, so a new engine has the current weights
        before the router sends it anything (the fleet admits it only then)."""
        import ray

        from rollout_manager.engines import engine_gpus

        if self.s.colocate:  # a fixed fleet, one engine per trainer GPU
            return
        asked, self._fleet_urls = self._fleet_urls, None
        urls = ray.get(asked if asked is not None else self.rollout.engine_urls.remote())
        if urls == self.engine_urls:
            return
        gpus = asyncio.run(engine_gpus(self.settings.rollout, urls))
        self.trainer.set_weight_sync_engines(urls, gpus)
        print(f"weight sync: the fleet has {len(urls)} engine(s) now: {', '.join(urls)}", flush=True)
        self.engine_urls = urls

    @crash_point_after("after_save")
    def maybe_save(self, step: int) -> None:
        """Checkpoint at each --save-interval step and the last (``checkpoint.save``); the buffer's
        consumption up to ``step`` becomes final with it (without --save: in ``log_step``'s buffer call)."""
        if not self.s.save:  # the commit rides in log_step's buffer call (it returns the metrics)
            self._commit_at = step
            return
        if not self.s.save_interval or (step + 1) % self.s.save_interval and step + 1 != self.s.num_rollout:
            return
        with self._timer("perf/save_time"):
            checkpoint.save(self.s.save, step, trainer=self.trainer, buffer=self.buffer, rollout=self.rollout,
                            producer=self._producer, first_rollout=self.first_rollout,
                            save_hf=self.settings.train.save_hf)

    def should_eval(self, step: int, before_train: bool = False) -> bool:
        """Whether to evaluate at ``step``: every ``--eval-interval`` steps and at the last one.

        ``before_train``: unless ``--skip-eval-before-train``. Never without ``--eval-interval`` or a rollout side.
        """
        if not self.s.eval_interval or self.rollout is None:
            return False
        if before_train:
            return not self.s.skip_eval_before_train
        return step % self.s.eval_interval == 0 or step == self.s.num_rollout

    def evaluate(self, step: int) -> None:
        """Run the rollout manager's evaluation, log its ``eval/...`` metrics at ``step`` and print the accuracy."""
        import ray

        with self._timer("perf/eval_time"):
            metrics = ray.get(self.rollout.evaluate.remote(step))
        self.logger.log(step, metrics)
        if isinstance(metrics.get(EVAL_ACCURACY.key), (int, float)):
            self._last_eval = (step, metrics[EVAL_ACCURACY.key])
        print(f"[eval @ step {step}] " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()
                                                   if k in ("eval/accuracy", "eval/reward_mean")), flush=True)

    def log_step(self, step: int, step_time: float) -> None:
        """Log this step's collected metrics (trainer, rollout, buffer, ``perf/...``) at ``step`` and start afresh."""
        self._pending[STEP_TIME.key] = step_time
        if self._producer is not None:  # the producer's rollouts finished since the last step
            self._pending.update(_mean_metrics(self._producer.drain_metrics()))
        self._pending.update(step_breakdown(self._pending))  # each Ray call's time outside its part
        if self.buffer is not None:
            commit_at, self._commit_at = self._commit_at, None
            m = (call_buffer(self.buffer, "metrics") if commit_at is None
                 else checkpoint.commit_without_checkpoint(self.buffer, commit_at))
            self._pending.update({f"buffer/{k}": v for k, v in m.items() if isinstance(v, (int, float))})
        self.logger.log(step, self._pending)
        self.steps_done += 1
        if self._bar is not None:
            reward = self._pending.get(ROLLOUT_REWARD_MEAN.key)
            self._bar.set_postfix_str(", ".join(
                ([f"step {step} rollout reward {reward:.3f}"] if isinstance(reward, float) else [])
                + ([f"eval accuracy {self._last_eval[1]:.3f} (step {self._last_eval[0]})"] if self._last_eval else [])),
                refresh=False)
        self._pending = {}

    def finish(self) -> None:
        """Tear down: stop the async producer, close the trainer ranks, shut the rollout manager down, close the log.

        Then plots the metrics (unless ``--no-plots``) and shuts Ray down if this run started it.
        """
        import ray

        if self._producer is not None:  # stops after its rollout in progress (or at shutdown)
            self._producer.stop(timeout_s=5.0)
        if self.trainer is not None:  # leaves the weight-update group before the engines stop
            self.trainer.close()
        if self.rollout is not None:
            try:
                ray.get(self.rollout.shutdown.remote(), timeout=60)
            except Exception as e:  # shutting down after a failure: report, keep tearing down
                print(f"rollout manager shutdown failed: {e}")
        if hasattr(self, "logger"):
            self.logger.close()
            if not self.s.no_plots and (self.output_dir / "metrics.jsonl").exists():
                self._plots = plot_metrics(self.output_dir / "metrics.jsonl", self.output_dir)
        if self._owns_ray:
            ray.shutdown()

    def summary(self) -> str:
        """The closing lines of a run that ended well: what ran, where its outputs are, the first,
        best and last evaluation, the wall time."""
        s, out = self.s, self.output_dir
        mode = ("rollout only (--debug-rollout-only)" if s.debug_rollout_only
                else "train only (--debug-train-only)" if s.debug_train_only
                else f"async (--max-weight-staleness {self.max_staleness})" if self.is_async else "sync")
        steps = (f"{self.steps_done} step(s), {self.start_step}-{self.start_step + self.steps_done - 1}"
                 if self.steps_done else "0 steps")
        total = time.monotonic() - self._started
        loop = time.monotonic() - self._loop_started if self._loop_started is not None else 0.0
        lines = [f"run finished: {steps} of --num-rollout {s.num_rollout}, {mode}"
                 + (f", resumed from {s.load}" if self.start_step else "")
                 + f"; wall time {duration(total)} ({duration(loop)} of it in the steps)"]
        metrics_file = out / "metrics.jsonl"
        if metrics_file.exists():
            lines += [f"  eval:        {e}" for e in [eval_line(read_metrics(metrics_file))] if e]
            lines.append(f"  metrics:     {metrics_file}")
        if self._plots:
            missing = [p.file for p in missing_plots(self._plots)]
            lines.append(f"  plots:       {', '.join(p.name for p in self._plots)} in {out}"
                         + (f" (no data for {', '.join(missing)})" if missing else ""))
        elif s.no_plots:
            lines.append("  plots:       none (--no-plots)")
        if (out / "tensorboard").is_dir():
            lines.append(f"  tensorboard: {out / 'tensorboard'}")
        last = checkpoint.latest(s.save)
        lines.append(f"  checkpoint:  {last['path']} (the last; --load {s.save} resumes)"
                     if last else "  checkpoint:  none (--save DIR writes them)")
        if (out / "logs").is_dir():
            lines.append(f"  engine logs: {out / 'logs'}")
        return "\n".join(lines)

    def resume_hint(self) -> str:
        """What to run after a failure: the last checkpoint and ``--load`` (exactly once from it)."""
        return checkpoint.resume_hint(self.s.save)

    # --- helpers -------------------------------------------------------------------------
    def _get_async(self, step: int) -> list[list[Any]]:
        deadline = time.monotonic() + self.settings.buffer.get_timeout_s
        while True:
            self._producer.check()
            wait = min(_GET_POLL_S, max(0.0, deadline - time.monotonic()))
            try:
                return call_buffer(self.buffer, "get", self.settings.rollout.sampling.rollout_batch_size,
                                   timeout_s=wait, step=step)
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise

    @contextlib.contextmanager
    def _timer(self, key: str):
        """Adds the block's wall time to this step's metric ``key`` (the per-step time split)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._pending[key] = self._pending.get(key, 0.0) + time.perf_counter() - t0


def start_ray(address: str | None) -> None:
    """Start (or join) Ray as every run does. A local cluster started here has Ray's token
    authentication on (Ray's default when ``RAY_AUTH_MODE`` is unset; the token is
    ``~/.ray/auth_token``): its dashboard agent, which Ray always starts and which runs job
    submissions as shell commands, then refuses calls without the token. ``RAY_AUTH_MODE=disabled``
    turns that off and is warned about. Joining a running cluster (``--ray-address``, or
    ``RAY_ADDRESS``) sends this node's token: Ray 2.60's ``ray start --head`` turns token auth on,
    but a client joining it would not send one unless ``RAY_AUTH_MODE`` says ``token`` (set here
    when unset, by :func:`token_auth_to_join`; docs/multinode.md).

    No ``address`` and no ``RAY_ADDRESS`` (``ray job submit`` sets it): a new local cluster, as
    ``--ray-address`` says. Ray's own ``None`` would first scan the machine's processes for a GCS and
    join the cluster ``ray start`` (or any other run) last began here, which on a shared machine is
    someone else's: from inside a network namespace its address does not answer and ``ray.init``
    retries for minutes."""
    token_auth_to_join(address)
    import ray

    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        print("warning: RAY_AUTH_MODE=disabled: Ray's job agent accepts unauthenticated job submissions "
              "(shell commands) from anyone who can reach it; unset it to keep Ray's token auth on", flush=True)
    if not address and not os.environ.get("RAY_ADDRESS"):
        address = "local"
    ray.init(address=address, include_dashboard=False, log_to_driver=True, configure_logging=True,
             logging_level="WARNING")


def token_auth_to_join(address: str | None) -> None:
    """Joining a running cluster (``address``, or ``RAY_ADDRESS``) with ``RAY_AUTH_MODE`` unset: set
    it to ``token``. Ray reads it when first imported, so this runs before anything imports Ray."""
    if (address or os.environ.get("RAY_ADDRESS")) and not os.environ.get("RAY_AUTH_MODE"):
        os.environ["RAY_AUTH_MODE"] = "token"


def _side_by_side(calls: list[Callable[[], None]]) -> None:
    """Run ``calls`` each in its own thread and wait for all; raise the first one's error (in
    ``calls`` order). Daemon threads: Ctrl-C while a part is starting ends the launcher at once
    instead of waiting for that part."""
    errors: list[BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            calls[i]()
        except BaseException as e:  # handed to the waiting thread
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e


def _mean_metrics(records: list[dict[str, float]]) -> dict[str, float]:
    """Per-key mean of several metric records (keys missing from some records average the rest)."""
    keys = {k for r in records for k in r}
    return {k: sum(r[k] for r in records if k in r) / sum(k in r for r in records) for k in keys}


def _is_plain(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, type(None))) or (isinstance(v, list) and all(map(_is_plain, v)))
