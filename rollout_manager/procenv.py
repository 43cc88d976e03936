"""The environment an engine process starts with, the same for a local engine and one started by
its Ray ``EngineHost`` (``placement.py``): both import it from here, below either of them."""

from __future__ import annotations

import os

# Variables of this process that engines do not inherit: PyTorch allocator settings meant for
# the trainer (expandable segments), which SGLang's memory saver and CUDA graphs do not support
# (slime drops them before it starts SGLang for the same reason).
_NOT_INHERITED = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def child_environ(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine process: this process's (less ``_NOT_INHERITED``), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    env.update(extra or {})
    return env
