"""The parts of a run, built once from the parsed flags, and each step of the schedule as one
named method. ``scripts/train.py`` reads the schedule; this module does the wiring.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from arguments import launcher_settings_from_args
from metrics_log import MetricsLogger, plot_metrics

STATE_FILE = "driver_state.json"


class Run:
    """Everything one training run holds: Ray, the buffer, the rollout manager, the trainer
    ranks (a Ray actor group; rank 0 owns the weight sender), the metrics log, and the step to
    start from."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.s = launcher_settings_from_args(args)
        self.output_dir = Path(self.s.output_dir)
        self.start_step = 0
        self.buffer = self.rollout = self.trainer = None
        self.weight_sync_connected = False
        self._pending: dict[str, float] = {}
        self._async_ref = None
        self._owns_ray = False
        self.max_staleness = args.max_weight_staleness or 0
        self.is_async = self.max_staleness > 0 and not (self.s.debug_rollout_only or self.s.debug_train_only)

    # --- start-up ------------------------------------------------------------------------
    @classmethod
    def start(cls, args: argparse.Namespace) -> "Run":
        run = cls(args)
        run._maybe_build_toy_model()
        run._seed(args.seed)
        run.logger = MetricsLogger(run.output_dir, run.s.use_tensorboard, run.s.use_wandb, run.s.wandb_project,
                                   run_config={k: v for k, v in vars(args).items() if _is_plain(v)})
        run._start_ray()
        if not run.s.debug_train_only:
            run._start_rollout_side()
        if not run.s.debug_rollout_only:
            run._start_trainer()
        if run.s.load:
            run._resume(run.s.load)
        if run.trainer is not None and run.rollout is not None:
            run._connect_weight_sync()
        return run

    def _maybe_build_toy_model(self) -> None:
        ckpt = Path(self.args.hf_checkpoint or "")
        if self.args.build_toy_model and not (ckpt / "config.json").exists():
            import make_toy_model

            print(f"building the toy model at {ckpt} (--build-toy-model)")
            make_toy_model.main(["--out", str(ckpt), "--warmup-steps", str(self.args.toy_warmup_steps)])

    def _seed(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _start_ray(self) -> None:
        """Every mode needs Ray: the trainer ranks are actors too (--debug-train-only included)."""
        import ray

        if not ray.is_initialized():
            self._owns_ray = True
            ray.init(address=self.s.ray_address, include_dashboard=False, log_to_driver=True,
                     configure_logging=True, logging_level="WARNING")

    def _start_rollout_side(self) -> None:
        import ray

        from buffer import create_buffer
        from buffer.arguments import settings_from_args as buffer_settings
        from rollout_manager.arguments import settings_from_args as rollout_settings
        from rollout_manager.actor import create_rollout_manager_actor

        bs = buffer_settings(self.args)
        if bs.persist_dir is None and self.s.save:
            bs = dataclasses.replace(bs, persist_dir=str(Path(self.s.save) / "buffer"))
        self.buffer = create_buffer(self.s.buffer_name, bs, plugin_args=self.args)
        (self.output_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.rollout = create_rollout_manager_actor(rollout_settings(self.args, self.args.sglang_args), self.args,
                                                    str((self.output_dir / "logs").resolve()))
        self.engine_urls = ray.get(self.rollout.start.remote())

    def _start_trainer(self) -> None:
        """The trainer ranks (--actor-num-nodes x --actor-num-gpus-per-node), one Ray actor each;
        one rank is the same code path."""
        from train_backend.actor_group import TrainerGroup
        from train_backend.arguments import group_settings_from_args
        from train_backend.arguments import settings_from_args as train_settings
        from train_backend.megatron.arguments import settings_from_args as megatron_settings

        self.trainer = TrainerGroup(train_settings(self.args), megatron_settings(self.args),
                                    group_settings_from_args(self.args))
        print("trainer ranks: " + ", ".join(f"{p['rank']}@{p['node']}" + (f" gpu {p['gpus']}" if p["gpus"] else "")
                                            for p in self.trainer.placement()), flush=True)

    def _connect_weight_sync(self) -> None:
        from weight_sync.arguments import settings_from_args as sync_settings

        # rank 0 records each pushed version in the buffer (its actor handle travels to the rank)
        self.trainer.connect_weight_sync(sync_settings(self.args), self.engine_urls, self.buffer)
        self.weight_sync_connected = True
        if self.start_step > 0:  # resumed: the engines still serve the initial checkpoint
            self.update_weights(self.start_step)

    # --- the schedule's steps --------------------------------------------------------------
    def progress(self, steps: Iterable[int]):
        from tqdm import tqdm

        return tqdm(steps, desc="train" if not self.s.debug_rollout_only else "rollout", unit="step",
                    initial=self.start_step, total=self.args.num_rollout, dynamic_ncols=True)

    def start_async_rollout(self) -> None:
        """Async mode: the rollout manager produces into the buffer, at most K steps ahead of
        the trainer, until ``finish`` stops it (groups dropped as stale are made up for)."""
        self._async_ref = self.rollout.run_async.remote(self.start_step, 1 << 40, self.buffer,
                                                        self.max_staleness)

    def generate(self, step: int) -> None:
        """Sync mode: put this step's groups into the buffer.

        The put is tagged ``rollout-{step}``: after a resume, the step that was in flight at the
        crash is generated again from the checkpointed data position, and the buffer stores it
        only if the first attempt never reached it. So the data position stays exact too.
        """
        import ray

        if self.rollout is None:  # --debug-train-only: batches come from files
            return
        with self._timer("perf/rollout_time"):
            self._pending.update(ray.get(self.rollout.push.remote(step, self.buffer)))

    def get_batch(self, step: int) -> list[list[Any]]:
        """Take this step's groups: from the buffer, or from a debug dump (--debug-train-only)."""
        import ray

        from buffer.arrow import read_parquet, write_parquet

        with self._timer("perf/buffer_wait_time"):
            if self.s.debug_train_only:
                groups = read_parquet(self.s.load_debug_rollout_data.format(rollout_id=step))
            else:
                groups = ray.get(self.buffer.get.remote(self.args.rollout_batch_size, step=step))
                if self._async_ref is not None:
                    self._check_async_producer()
        if self.s.save_debug_rollout_data:
            write_parquet(groups, self.s.save_debug_rollout_data.format(rollout_id=step))
        if self.max_staleness or self.is_async:
            lags = [step - min(s.weight_versions) for g in groups for s in g]
            self._pending["perf/staleness_max"] = float(max(lags))
        return groups

    def train(self, step: int, groups: list[list[Any]]) -> None:
        if self.trainer is None:  # --debug-rollout-only
            return
        with self._timer("perf/train_time"):
            self._pending.update(self.trainer.train_step(groups, step))

    def update_weights(self, version: int) -> None:
        """Push the trainer's weights to every engine; the buffer's version becomes ``version``."""
        if not self.weight_sync_connected:
            return
        with self._timer("perf/weight_sync_time"):
            metrics = self.trainer.push_weights(version)
        self._pending.update({k if "/" in k else f"weight_sync/{k}": v for k, v in metrics.items()})

    def maybe_save(self, step: int) -> None:
        if not self.s.save or not self.s.save_interval or (step + 1) % self.s.save_interval and \
                step + 1 != self.args.num_rollout:
            return
        import ray

        with self._timer("perf/save_time"):
            path = Path(self.s.save) / f"step_{step:06d}"
            if self.trainer is not None:
                self.trainer.save(str(path / "trainer"))
                if self.args.save_hf:
                    self.trainer.export_hf(self.args.save_hf.format(rollout_id=step))
            # the driver's own RNGs; each trainer rank's are in its backend checkpoint (rng_<rank>.pt)
            state = {"step": step, "rng": _rng_state()}
            if self.rollout is not None:
                state["rollout"] = ray.get(self.rollout.state_dict.remote())
            _write_json(path / STATE_FILE, state)
            _write_json(Path(self.s.save) / "latest.json", {"step": step, "path": str(path)})
            if self.buffer is not None:  # consumption up to `step` is final only now
                ray.get(self.buffer.commit.remote(step))

    def should_eval(self, step: int, before_train: bool = False) -> bool:
        if not self.s.eval_interval or self.rollout is None:
            return False
        if before_train:
            return not self.s.skip_eval_before_train
        return step % self.s.eval_interval == 0 or step == self.args.num_rollout

    def evaluate(self, step: int) -> None:
        import ray

        with self._timer("perf/eval_time"):
            metrics = ray.get(self.rollout.evaluate.remote(step))
        self.logger.log(step, metrics)
        print(f"[eval @ step {step}] " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()
                                                   if k in ("eval/accuracy", "eval/reward_mean")), flush=True)

    def log_step(self, step: int, step_time: float) -> None:
        import ray

        self._pending["perf/step_time"] = step_time
        if self._async_ref is not None:  # the producer's rollouts finished since the last step
            self._pending.update(_mean_metrics(ray.get(self.rollout.drain_metrics.remote())))
        if self.buffer is not None:
            m = ray.get(self.buffer.metrics.remote())
            self._pending.update({f"buffer/{k}": v for k, v in m.items() if isinstance(v, (int, float))})
        self.logger.log(step, self._pending)
        self._pending = {}

    def finish(self) -> None:
        import ray

        if self._async_ref is not None:
            ray.get(self.rollout.stop_async.remote())
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
                plot_metrics(self.output_dir / "metrics.jsonl", self.output_dir)
        if self._owns_ray:
            ray.shutdown()

    # --- resume --------------------------------------------------------------------------
    def _resume(self, load_dir: str) -> None:
        import ray

        latest = Path(load_dir) / "latest.json"
        if not latest.exists():
            raise ValueError(f"--load {load_dir}: no latest.json (not a checkpoint directory written by --save)")
        path = Path(json.loads(latest.read_text())["path"])
        state = json.loads((path / STATE_FILE).read_text())
        if self.trainer is not None:
            self.trainer.load(str(path / "trainer"))
        if self.rollout is not None and "rollout" in state:
            ray.get(self.rollout.load_state_dict.remote(state["rollout"]))
        if self.buffer is not None:
            returned = ray.get(self.buffer.rewind.remote(state["step"]))
            print(f"resumed from {path}: step {state['step']}, {returned} consumed-but-untrained groups back in the buffer")
        _set_rng_state(state["rng"])
        self.start_step = state["step"] + 1

    # --- helpers -------------------------------------------------------------------------
    def _check_async_producer(self) -> None:
        import ray

        done, _ = ray.wait([self._async_ref], timeout=0)
        if done:  # the producer ended early: surface its error instead of waiting on the buffer
            ray.get(self._async_ref)

    @contextlib.contextmanager
    def _timer(self, key: str):
        """Adds the block's wall time to this step's metric ``key`` (the per-step time split)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._pending[key] = self._pending.get(key, 0.0) + time.perf_counter() - t0


def _mean_metrics(records: list[dict[str, float]]) -> dict[str, float]:
    """Per-key mean of several metric records (keys missing from some records average the rest)."""
    keys = {k for r in records for k in r}
    return {k: sum(r[k] for r in records if k in r) / sum(k in r for r in records) for k in keys}


def _is_plain(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, type(None))) or (isinstance(v, list) and all(map(_is_plain, v)))


def _rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": repr(random.getstate()), "numpy": [name, keys.tolist(), pos, has_gauss, cached],
            "torch": torch.get_rng_state().tolist()}


def _set_rng_state(state: dict[str, Any]) -> None:
    import ast

    random.setstate(ast.literal_eval(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _write_json(path: Path, obj: Any) -> None:
    """Atomic write: a crash leaves the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)
