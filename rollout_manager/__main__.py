"""Run the rollout manager alone: generate and score rollouts without a trainer.

    python -m rollout_manager --hf-checkpoint DIR --prompt-data FILE --input-key prompt \\
        --label-key label --apply-chat-template --rollout-num-engines 2 --n-samples-per-prompt 4 \\
        --rollout-batch-size 8 --rollout-max-response-len 64 --output runs/rollout/groups.parquet

It starts the engines and sglang-router (or uses ``--sglang-router-ip/--sglang-router-port`` or
``--engine-urls``), streams the prompts, shows progress, writes the groups as Parquet (the
Sample format, ``buffer.arrow``) or pushes them into a running buffer (``--buffer NAME``), and
ends with a summary: rewards, pass rate, lengths, truncation, tokens/s, failures by reason, then
what ran, where its output and logs are, and the wall time. The files it reads are checked before
anything starts.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from dataclasses import dataclass

from buffer.sample import TRAINABLE as _TRAINABLE
from flags import SettingError, add_flags, flag, from_args
from flags.parser import ArgumentParser

from rollout_manager.arguments import (add_arguments, check_input_files, settings_from_args, split_sglang_args,
                                      with_engine_admin_key)
from rollout_manager.settings import RolloutLoopSettings
from rollout_manager.summary import format_summary, merge_metrics


class RunFailed(RuntimeError):
    """The run ended without a usable result; ``metrics`` is what it did (printed as the summary)."""

    def __init__(self, message: str, metrics: dict[str, float]):
        super().__init__(message)
        self.metrics = metrics


@dataclass
class CliSettings(RolloutLoopSettings):
    """The standalone command's own settings (the launcher has its own loop and flags); each field
    declares its flag (:mod:`flags`), ``--num-rollout`` and ``--ray-address`` the launcher's
    (:class:`~rollout_manager.settings.RolloutLoopSettings`), with :data:`STANDALONE_DEFAULTS`."""

    output: str | None = flag(None, "write the groups to this Parquet file")
    buffer: str | None = flag(None, "push the groups into this running buffer actor instead")
    log_dir: str | None = flag(None, "engine and router logs (default: a temp dir)")
    evaluate: bool = flag(False, "also evaluate --eval-prompt-data")

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.output is None) == (self.buffer is None):
            raise SettingError(("output", "buffer"), "{output} FILE and {buffer} NAME: give exactly one of the two")


# The shared flags' defaults for a standalone run (overrides of their one declaration, not a second
# one): one step is the unit of a look at the rollouts or of a data set written with --output (the
# launcher's 10 are training steps), and --buffer names an actor of a cluster that is already running
# (a local cluster started here would not have it).
STANDALONE_DEFAULTS = {"num_rollout": 1, "ray_address": "auto"}


def build_parser() -> argparse.ArgumentParser:
    """The standalone command's parser: its own flags, then the rollout manager's (as the launcher's)."""
    p = ArgumentParser(prog="python -m rollout_manager", description=__doc__.split("\n\n")[0],
                       allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(p, CliSettings, "standalone run")
    p.set_defaults(**STANDALONE_DEFAULTS)
    add_arguments(p)
    return p


def cli_settings(args: argparse.Namespace) -> CliSettings:
    """Build (and so check) :class:`CliSettings`; ``ValueError`` names the flags."""
    return from_args(CliSettings, args)


async def run(args: argparse.Namespace, sglang_args: list[str]) -> dict[str, float]:
    started = time.monotonic()
    cli = cli_settings(args)
    settings = with_engine_admin_key(settings_from_args(args, sglang_args))
    check_input_files(settings)  # before the slow imports (transformers), the tokenizer and any engine

    from tqdm import tqdm

    from buffer.arrow import write_parquet
    from rollout_manager.manager import RolloutManager

    manager = RolloutManager(settings, args, log_dir=cli.log_dir)
    report = manager.data_report
    print(f"prompts: {report.loaded} loaded, {len(report.skipped)} bad lines skipped {report.skipped_by_reason or ''}")
    buffer_handle = None
    if cli.buffer is not None:
        import ray

        from buffer.interfaces import NAMESPACE, get_buffer
        if not ray.is_initialized():  # (a caller that already joined a cluster keeps it)
            ray.init(address=cli.ray_address, namespace=NAMESPACE, log_to_driver=False)
        buffer_handle = get_buffer(cli.buffer)
    await manager.start()
    print(f"engines: {manager.engine_urls} behind router {manager.router_url}")
    all_groups, per_step = [], []
    failure: str | None = None
    key = settings.plugins.reward_key
    try:
        total = cli.num_rollout * settings.sampling.rollout_batch_size
        # the scored rewards of the kept groups of all steps: their mean ends at the summary's
        # rollout/reward_mean (the steps' means, averaged) when each step scored as many samples
        rewards: list[float] = []
        with tqdm(total=total, unit="group", desc="groups kept") as bar:
            def on_group(group, kept):
                if not kept:
                    return
                bar.update(1)
                rewards.extend(v for v in (_reward_value(s.reward, key) for s in group) if v is not None)
                if rewards:
                    bar.set_postfix_str(f"mean reward so far {sum(rewards) / len(rewards):.4f}", refresh=False)
            from rollout_manager.rollout import RolloutFailed
            for rollout_id in range(cli.num_rollout):
                try:
                    if buffer_handle is not None:
                        per_step.append(await manager.push(rollout_id, buffer_handle))
                    else:
                        groups, metrics = await manager.generate(rollout_id, on_group=on_group)
                        all_groups += groups
                        per_step.append(metrics)
                except RolloutFailed as e:
                    per_step.append(e.metrics)
                    failure = str(e)
                    break
                bar.n = min(total, (rollout_id + 1) * settings.sampling.rollout_batch_size)
                bar.refresh()
        metrics = merge_metrics(per_step)
        if cli.evaluate and failure is None:
            metrics.update(await manager.evaluate(cli.num_rollout))
    finally:
        await manager.shutdown()
    if cli.output is not None:
        size = write_parquet(all_groups, cli.output)
        print(f"wrote {len(all_groups)} groups ({sum(map(len, all_groups))} samples, {size} bytes) to {cli.output}")
    if failure is None and _nothing_succeeded(all_groups if cli.output is not None else None, metrics):
        failure = "no sample succeeded" + (f" ({_top_failures(metrics)})" if _top_failures(metrics) else "")
    if failure is not None:
        raise RunFailed(failure, metrics)
    print(format_summary(metrics, f"rollout summary ({_what_ran(cli, settings)}; per-step means averaged over "
                                  "the steps, counts summed)"))
    where = f"groups in {cli.output}" if cli.output is not None else f"groups pushed into buffer {cli.buffer}"
    evaluated = f"; eval/accuracy {metrics['eval/accuracy']:.4g}" if "eval/accuracy" in metrics else ""
    print(f"rollout finished: {_what_ran(cli, settings)}{evaluated}; {where}; engine and router logs in "
          f"{manager.log_dir}; wall time {time.monotonic() - started:.1f}s")
    return metrics


def _what_ran(cli: CliSettings, settings) -> str:
    s = settings.sampling
    return (f"{cli.num_rollout} step(s) of {s.rollout_batch_size} prompts x {s.n_samples_per_prompt} samples"
            + (", then one evaluation" if cli.evaluate else ""))


def _reward_value(reward, key):
    if isinstance(reward, dict):
        reward = reward.get(key) if key is not None else None
    return float(reward) if isinstance(reward, (int, float)) else None


def _nothing_succeeded(groups, metrics: dict[str, float]) -> bool:
    if groups is not None:
        return not any(s.status in _TRAINABLE for g in groups for s in g)
    n = metrics.get("rollout/num_samples")  # pushed to a buffer: only the counts are here
    return n is not None and (n == 0 or metrics.get("rollout/failed_frac", 0.0) >= 1.0)


def _top_failures(metrics: dict[str, float]) -> str:
    failures = sorted(((v, k.split("failures/", 1)[1]) for k, v in metrics.items() if "/failures/" in k), reverse=True)
    return ", ".join(f"{reason} x{int(n)}" for n, reason in failures[:3])


def main(argv: list[str] | None = None) -> dict[str, float]:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ours, sglang_args = split_sglang_args(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(ours)
    try:
        return asyncio.run(run(args, sglang_args))
    except RunFailed as e:  # the summary of what was done, then one line saying why, exit status 1
        print(format_summary(e.metrics))
        print(f"python -m rollout_manager: error: {e}", file=sys.stderr)
        sys.exit(1)
    except ValueError as e:  # configuration errors: one line naming the flag, no traceback
        parser.error(str(e))
        raise


if __name__ == "__main__":
    main()
