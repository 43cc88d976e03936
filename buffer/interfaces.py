"""The buffer's public surface: its settings (from ``buffer.settings``) and how to create / find the
named Ray actor.

The rollout manager pushes finished groups with ``put``; the trainer pulls them with ``get``.
Both find the one buffer actor by name (``get_buffer``), from any process of the Ray cluster.

Exactly-once protocol (what ``commit``/``rewind`` are for): the driver trains step ``k`` on
``get(n, step=k)``, checkpoints the trainer, then calls ``commit(k)``; on resume from the
checkpoint of step ``s`` it calls ``rewind(s)``, which puts every group handed out to steps
``> s`` back at the front of the queue. Producers pass a ``put_id`` and retry a failed put with
the same id, so a put whose reply was lost is not stored twice. Calls are never retried by
Ray itself (``max_task_retries=0``): a retried ``get`` would hand out a second batch.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from buffer.settings import BufferSettings, load_filter  # noqa: F401  (the public surface)

if TYPE_CHECKING:  # ray is imported lazily: `import buffer` must stay cheap for plugins
    import ray

NAMESPACE = "reservoir"
START_TIMEOUT_S = 300.0  # create_buffer waits this long for the actor to start (and recover)


def create_buffer(name: str, settings: BufferSettings, plugin_args: argparse.Namespace | None = None, *,
                  namespace: str = NAMESPACE, detached: bool = False,
                  actor_options: dict[str, Any] | None = None) -> "ray.actor.ActorHandle":
    """Start (or find, if it already runs) the named buffer actor; Ray must be initialised.

    With ``settings.persist_dir`` the actor is restartable (``max_restarts=-1``) and recovers its
    state from disk in ``__init__``, after a crash or when a new job points at the same directory;
    it is pinned to the caller's node, so a restart finds the same local disk (pass a
    ``scheduling_strategy`` in ``actor_options`` when the directory is on a shared filesystem).
    ``plugin_args`` is the namespace handed to the filter plugin (slime's contract).
    ``detached`` keeps the actor alive after the creating driver exits. ``actor_options``
    overrides Ray options (e.g. ``num_cpus`` or a scheduling strategy).
    """
    import ray

    from buffer.actor import BufferActor

    load_filter(settings)  # fail at start-up, in the caller, not inside the actor
    options: dict[str, Any] = dict(
        name=name, namespace=namespace, get_if_exists=True,
        num_cpus=0,  # waits on I/O and the event loop; takes no CPU slot from trainers/engines
        max_restarts=-1 if settings.persist_dir else 0,
        max_task_retries=0,  # see the module docstring: callers retry with put_id / rewind
        max_concurrency=1000,
    )
    if detached:
        options["lifetime"] = "detached"
    if settings.persist_dir:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
            node_id=ray.get_runtime_context().get_node_id(), soft=False)
    options.update(actor_options or {})
    handle = BufferActor.options(**options).remote(settings, plugin_args)
    # Surfaces __init__ errors (e.g. an unusable --buffer-dir) here, as ActorDiedError with the cause.
    ray.get(handle.ping.remote(), timeout=START_TIMEOUT_S)
    return handle


def get_buffer(name: str, namespace: str = NAMESPACE) -> "ray.actor.ActorHandle":
    """The handle of a running buffer actor, from any process of the cluster."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError as e:
        raise ValueError(f"no buffer actor named {name!r} in namespace {namespace!r} "
                         f"(check --buffer-name; create it with create_buffer): {e}") from e
