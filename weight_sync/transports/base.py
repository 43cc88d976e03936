"""What a transport is: the part of a push that moves the bytes, behind a few methods.

``WeightSender`` (``weight_sync/sender.py``) keeps the engines (validation, revive, retries,
versions, metrics) and runs SGLang's sequence; a transport is called at fixed points of it:

- ``connect(engines)`` once, after the engines' parameter lists are fetched;
- ``plan(named, sent)``: what travels how (a ``Payload``: buckets, and held tensors);
- ``before_push(engines)`` once per push, before its attempts;
- ``prepare(members, payload)`` per attempt, before ``/pause_generation`` (the engines still
  generate): join or reuse what the transport needs, pack bucket 0;
- ``send(members, payload, version, progress, resume)`` between ``/begin_weight_update`` and
  ``/end_weight_update`` (``sessions`` False: no session is opened around it);
- ``finish()`` once the session is closed (or failed), before the check and the continue;
- ``after_failure(members, alive)`` when an attempt failed, after the sender marked the engines;
- ``holds_weights`` / ``release(members)``: engines that hold the trainer's tensors between pushes
  are let go inside a session when the sender closes;
- ``close(alive)`` last.

A new transport (a delta, P2P) is one class with ``send`` and what else it needs of these.
``start_packing`` and ``send_buckets`` are the pipelined bucket loop the transports share.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

from weight_sync.engines import EngineState
from weight_sync.interfaces import Named, TensorSpec, WeightSyncSettings
from weight_sync.plan import Bucket, plan_buckets

#: ``progress(done, total)``, called after each bucket.
Progress = Callable[[int, int], None]
#: ``mark(event, bucket index or -1)``: records the push's timeline (``WeightSender.trace``).
Mark = Callable[[str, int], None]
#: Starts ``/end_weight_update`` then ``/continue_generation`` on the members; returns its task.
Resume = Callable[[], "asyncio.Future[None]"]

P = TypeVar("P")
R = TypeVar("R")


@dataclass
class Payload:
    """One push as planned: the tensors, their buckets (indices into ``named``), and ``held``: the
    indices that travel as handles the engines keep (``mapped``), outside any bucket."""

    named: Named
    buckets: list[Bucket]
    held: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """What the engines read: the buckets, and the held tensors as the trainer holds them."""
        return sum(b.nbytes for b in self.buckets) + sum(self.named[i][1].nbytes for i in self.held)

    def cast_tensors(self, specs: list[TensorSpec], sent: list[TensorSpec]) -> int:
        """How many tensors are cast while their bucket is packed (``specs``: as given, ``sent``: as
        they travel); held tensors travel as they are: the engine casts them while copying."""
        held = set(self.held)
        return sum(a.dtype != b.dtype for i, (a, b) in enumerate(zip(specs, sent)) if i not in held)


class Transport:
    """The default of every step is to do nothing; ``send`` is each transport's own."""

    #: whether ``send`` runs inside SGLang's ``/begin_weight_update`` ... ``/end_weight_update`` session
    sessions: bool = True

    def __init__(self, settings: WeightSyncSettings, mark: Mark):
        self.settings = settings  # the sender's own copy, shared: a change to it is seen here
        self.mark = mark

    async def connect(self, engines: list[EngineState]) -> None:
        """At ``WeightSender.connect``, once every engine's parameter list is known."""

    def plan(self, named: Named, sent: list[TensorSpec]) -> Payload:
        """Split the push into buckets (``sent``: each tensor's spec as it travels)."""
        return Payload(named, plan_buckets(sent, self.settings.bucket_bytes))

    async def before_push(self, engines: list[EngineState]) -> None:
        """Once per push, before its attempts (``engines``: all of them, dead ones included)."""

    async def prepare(self, members: list[EngineState], payload: Payload, keep: bool = True) -> float:
        """Before the engines pause: get ready to send ``payload`` to ``members``. ``keep``: what is
        built for ``members`` outlives this update (False: a resync of one engine; ``finish`` drops
        it). Returns the seconds spent joining ``members`` (``weight_sync/connect_s``)."""
        return 0.0

    async def send(self, members: list[EngineState], payload: Payload, version: int, progress: Progress | None,
                   resume: Resume | None) -> float:
        """Send ``payload`` as version ``version``; returns the seconds spent sending. ``resume``, if
        given, may be called once, as soon as generation may go on before ``send`` returns (the sender
        does it after ``send`` otherwise). PushFailed naming each engine that failed."""
        raise NotImplementedError

    async def finish(self) -> None:
        """After the update's session is closed (or failed)."""

    async def after_failure(self, members: list[EngineState], alive: set[str]) -> None:
        """An attempt over ``members`` failed; ``alive``: the urls of those that still answer."""

    @property
    def holds_weights(self) -> bool:
        """Whether the engines hold the trainer's tensors between pushes (``release`` lets them go)."""
        return False

    async def release(self, members: list[EngineState]) -> None:
        """Inside a session, at close: let ``members`` drop the trainer's tensors they hold."""

    async def close(self, alive: set[str]) -> None:
        """Last, when the sender closes (``alive``: urls of the engines alive)."""

    def metrics(self) -> dict[str, float]:
        """The transport's own metrics of the push that just succeeded (merged into the push's)."""
        return {}


def last_bucket(settings: WeightSyncSettings, version: int, last: bool) -> dict[str, Any]:
    """``weight_version`` and ``flush_cache`` of a bucket: only the last one carries the version (an
    engine reports v only once all of v is in place) and flushes the cache, only after an ``abort``
    pause: ``in_place`` and ``retract`` keep the requests (running, or back in the waiting queue), and
    SGLang 0.5.15's flush then fails an assertion in its scheduler, which ends the server (seen on the
    GPU tier; 0.5.23 refuses the flush)."""
    return {"weight_version": str(version) if last else None,
            "flush_cache": last and settings.pause_mode == "abort"}


def start_packing(pack: Callable[[], P], here: bool) -> "asyncio.Future[P]":
    """Start packing a bucket: ``here`` (on a GPU: it only queues the copies) right away; else (on
    the CPU) in a worker thread."""
    loop = asyncio.get_running_loop()
    if here:
        fut = loop.create_future()
        fut.set_result(pack())
        return fut
    return loop.run_in_executor(None, pack)


async def send_buckets(n: int, pack: Callable[[int], "asyncio.Future[P]"],
                       send: Callable[[int, P, Callable[[], None] | None], Awaitable[R]],
                       staged: "list[asyncio.Future[P]]", progress: Progress | None, mark: Mark,
                       answered: Callable[[int, R], Awaitable[None]] | None = None) -> None:
    """Send buckets ``0..n-1`` in turn: ``pack(i)`` starts packing bucket i (``staged``: ``[bucket
    0's]`` if packed before the pause, emptied here), ``send(i, packed, after_issue)`` sends it,
    running ``after_issue()`` (which starts packing bucket i+1) once the requests are out, so the
    next bucket is packed while this one travels; ``answered(i, result)`` runs once every engine
    has answered bucket i. A packed bucket is held in names and lists that are dropped or emptied
    once it is answered, so no frame keeps it longer."""
    nxt: "asyncio.Future[P] | None" = staged.pop() if staged else pack(0)
    for i in range(n):
        packed, nxt = await nxt, None  # the future holds the bucket as long as a name holds it
        mark("packed", i)
        pending: list = []

        def after(i: int = i) -> None:
            pending.append(pack(i + 1))
        try:
            out = await send(i, packed, None if i == n - 1 else after)
        except BaseException:
            await asyncio.gather(*pending, return_exceptions=True)  # CPU: a thread may still fill a slot
            raise
        mark("answered", i)
        del packed
        if pending:
            nxt = pending.pop()
        if answered is not None:
            await answered(i, out)
        if progress is not None:
            progress(i + 1, n)

