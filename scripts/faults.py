"""Fault injection for the reliability tests, which stop a run at an exact place (docs/reliability.md).

``RESERVOIR_CRASH_AT`` is a comma-separated list of ``<point>:<step>`` (SIGKILL the driver there),
``buffer@<point>:<step>`` (SIGKILL the buffer actor's process, then go on),
``trainer@<point>:<step>`` (kill the last trainer rank's process, then go on: the next trainer
call fails), ``router@<point>:<step>`` and ``engine@<point>:<step>`` (SIGKILL the router, or
engine 0, then go on: the fleet's monitor restarts it). Two drills of an elastic fleet change it
there by the rollout manager's admin calls, then go on: ``grow@<point>:<step>`` adds two engines
(returning once they answer), ``shrink@<point>:<step>`` removes the fleet's first engine.
``hold@<point>:<step>`` holds the run there for a test that changes the cluster meanwhile (a node
joins or dies): it writes ``held_<point>_<step>`` into ``$RESERVOIR_HOLD_DIR`` and goes on once
``release_<point>_<step>`` appears there.

The points are the ends of the schedule's steps: ``after_get``, ``after_train``, ``after_push``
and ``after_save``, each marked on its ``Run`` method by :func:`crash_point_after` (so the
driver's loop holds the schedule alone). One point lies inside a call:
``trainer@in_push:<step>`` (:func:`die_in_push`).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from typing import Any, Callable

CRASH_ENV = "RESERVOIR_CRASH_AT"
HOLD_ENV = "RESERVOIR_HOLD_DIR"
_HOLD_S = 600.0  # a hold no test released by then goes on (the test has failed meanwhile)
TARGETS = ("", "buffer", "trainer", "router", "engine", "grow", "shrink", "hold")  # "": the driver


def crash_targets(point: str, step: int) -> list[str]:
    """What ``RESERVOIR_CRASH_AT`` kills at ``point`` of ``step`` (``""``: the driver); raises
    ValueError for a spec there naming an unknown target."""
    targets = []
    for spec in filter(None, os.environ.get(CRASH_ENV, "").split(",")):
        target, _, where = spec.rpartition("@")
        if where != f"{point}:{step}":
            continue
        if target not in TARGETS:
            raise ValueError(f"{CRASH_ENV}={spec!r}: unknown target {target!r} "
                             "(buffer, trainer, router, engine, grow, shrink, hold, or none)")
        targets.append(target)
    return targets


def crash_point(run: Any, point: str, step: int) -> None:
    """Kill what ``RESERVOIR_CRASH_AT`` names for ``point`` of ``step``, if anything. ``run``: the
    driver's ``Run`` (its ``buffer``, ``trainer`` and ``rollout`` handles)."""
    targets = crash_targets(point, step)
    if not targets:
        return
    import ray

    for target in targets:
        if target == "hold":
            hold(point, step)
            continue
        if target in ("grow", "shrink"):
            print(f"{CRASH_ENV}: {target} the engine fleet at {point} of step {step}", flush=True)
        else:
            print(f"{CRASH_ENV}: SIGKILL {target or 'driver'} at {point} of step {step}", flush=True)
        if target == "grow":
            ray.get(run.rollout.add_engines.remote(2))
        elif target == "shrink":
            ray.get(run.rollout.remove_engine.remote(ray.get(run.rollout.engine_urls.remote())[0]))
        elif target == "buffer":
            os.kill(ray.get(run.buffer.ping.remote()), signal.SIGKILL)
        elif target == "trainer":
            kill_actor(run.trainer.ranks[-1])
        elif target in ("router", "engine"):
            ray.get(run.rollout.kill.remote(target))
        else:
            os.kill(os.getpid(), signal.SIGKILL)


def crash_point_after(point: str, step_of: Callable[[int], int] = lambda step: step) -> Callable:
    """Decorator of a ``Run`` method whose first argument is a step (or, with ``step_of``, what
    gives it): the crash point ``point`` of that step, once the method returned."""
    def mark(method: Callable) -> Callable:
        @functools.wraps(method)
        def with_crash_point(run: Any, step: int, *args: Any, **kwargs: Any) -> Any:
            out = method(run, step, *args, **kwargs)
            crash_point(run, point, step_of(step))
            return out
        return with_crash_point
    return mark


def hold(point: str, step: int) -> None:
    """``hold@<point>:<step>``: say so in ``$RESERVOIR_HOLD_DIR``, then wait for the test's release."""
    where = os.environ.get(HOLD_ENV)
    if not where:
        raise ValueError(f"{CRASH_ENV}=hold@{point}:{step} needs {HOLD_ENV} (the directory of its files)")
    print(f"{CRASH_ENV}: holding at {point} of step {step}", flush=True)
    open(os.path.join(where, f"held_{point}_{step}"), "w").close()
    release = os.path.join(where, f"release_{point}_{step}")
    deadline = time.monotonic() + _HOLD_S
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.1)


def die_in_push(step: int) -> Callable[[int, int], None] | None:
    """``trainer@in_push:<step>``: a push progress callback with which trainer rank 0, the
    pushing rank, SIGKILLs itself once the engines answered the first bucket of step ``step``'s
    push, so it dies with the engines paused, inside a weight-update session, holding part of
    the new weights. Else None."""
    if "trainer" not in crash_targets("in_push", step):
        return None
    print(f"{CRASH_ENV}: SIGKILL trainer rank 0 in the push of step {step}", flush=True)

    def die(done: int, total: int) -> None:  # defined here: Ray pickles it by value for rank 0
        os.kill(os.getpid(), signal.SIGKILL)
    return die


def kill_actor(actor: Any, timeout_s: float = 60.0) -> None:
    """End an actor's process now (``ray.kill``) and return once Ray reports it dead, so the next
    call to it fails as a dead process's would (the kill itself is asynchronous)."""
    import ray

    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
    raise TimeoutError(f"{CRASH_ENV}: the actor did not die within {timeout_s:.0f} s of ray.kill")
