"""Reservoir's launcher: RL post-training end to end, in one short driver.

    python scripts/train.py --config examples/toy/grpo_cpu.yaml --output-dir runs/toy

Sync mode (``--max-weight-staleness`` 0 or unset): rollout step k, train step k, weight sync,
repeat. Async mode (``--max-weight-staleness K > 0``): the rollout manager keeps producing into
the buffer while the trainer trains; the buffer withholds groups more than K versions old.
The two modes differ only in where the driver waits: on the rollout (sync) or on the buffer.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: Python put scripts/ first on sys.path; the repo root instead,
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # so its siblings import as scripts.x (scripts/__init__.py)

from scripts.arguments import parse  # noqa: E402


class Terminated(KeyboardInterrupt):
    """SIGTERM (a batch system's stop: Slurm's time limit, Kubernetes, ``timeout``), ended as Ctrl-C is."""


def _terminated(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> Path:
    args, settings = parse(argv)  # args: only what plugins get; the run reads settings. Checks the input files
    from buffer.ray_errors import error_line
    from scripts.components import Run  # after parse: its imports (torch) are slow, a usage error is not

    try:
        run = Run.start(args, settings)  # Ray, buffer, rollout manager + engines + router, trainer, weight sync; resume
    except ValueError as e:  # a bad setting found while starting a part (a plugin path, ...)
        sys.exit(f"scripts/train.py: error: {e}")
    step = run.start_step
    # Ray's start made SIGTERM a bare exit in this process; from here it ends the run as Ctrl-C does
    if threading.current_thread() is threading.main_thread():  # (only the main thread may set a handler)
        signal.signal(signal.SIGTERM, _terminated)
    try:
        if run.should_eval(run.start_step, before_train=True):
            run.evaluate(run.start_step)
        if run.is_async:
            run.start_async_rollout()
        for step in run.progress(range(run.start_step, settings.launcher.num_rollout)):
            t0 = time.perf_counter()
            if not run.is_async:
                run.generate(step)  # sync: fill the buffer with this step's groups
            groups = run.get_batch(step)  # waits on the buffer (the only wait in async mode)
            run.train(step, groups)
            run.update_weights(step + 1)  # engines now serve version step+1
            run.maybe_save(step)
            if run.should_eval(step + 1):
                run.evaluate(step + 1)
            run.log_step(step, step_time=time.perf_counter() - t0)
    except (RuntimeError, TimeoutError, ValueError) as e:  # a part failed mid-run (a trainer rank died, ...)
        run.finish()
        if "\n" in str(e).strip():  # Ray's errors run over many lines: all of it first, the verdict last
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(f"scripts/train.py: error: step {step}: {error_line(e)}\n{run.resume_hint()}")
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the parts shut down, where the run stands said, no traceback
        run.finish()
        how = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        sys.exit(f"scripts/train.py: {how} in step {step}\n{run.resume_hint()}")
    except BaseException:
        run.finish()
        raise
    run.finish()
    print(run.summary(), flush=True)  # what ran, where its outputs are, eval first/best/last, wall time
    return run.output_dir


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C while the parts start or shut down
        sys.exit("scripts/train.py: interrupted")
