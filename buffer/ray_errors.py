"""Reading Ray's errors: the one home of that, for every part that starts or calls Ray actors.

It sits in ``buffer`` because that is the lowest Ray-aware package: the rollout manager, the trainer
group, weight_sync and the launcher's scripts all import it already (``buffer.sample``,
``buffer.retry``), so none of them has to import another for this.
"""

from __future__ import annotations


def creation_setting_error(e: BaseException) -> ValueError | None:
    """The ``ValueError`` (a bad setting; its message names the flag) behind a Ray actor's
    creation error, or None when the actor died of something else."""
    cause = e.__cause__ or getattr(e, "cause", None)
    if isinstance(cause, ValueError):
        return cause
    # Ray 2.60 keeps only the text of an error raised in the actor's __init__: recover the
    # ValueError's message so the caller reports it as a setting error
    messages = [line.split("ValueError: ", 1)[1] for line in str(e).splitlines() if "ValueError: " in line]
    return ValueError(messages[-1]) if messages else None


def error_line(e: BaseException) -> str:
    """One line saying what failed: for an exception Ray wraps (a ``RayTaskError``, whose first
    line only names the remote task) the remote exception's, with its type."""
    inner = e
    while isinstance(getattr(inner, "cause", None), BaseException) and inner.cause is not inner:
        inner = inner.cause
    first = (str(inner).strip().splitlines() or [""])[0]
    return first if inner is e and first else f"{type(inner).__name__}: {first}"
