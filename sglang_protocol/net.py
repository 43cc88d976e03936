"""Ports and JSON for the processes that speak SGLang's protocol: the one home of both.

Everything that opens a listening socket (the weight-update rendezvous, an engine, the router)
picks its port here, and every HTTP body of SGLang's API (client, embedded engine, instant engine)
is encoded and decoded here. This module sits in ``sglang_protocol`` because that is the lowest
package all of those users import (``weight_sync`` and ``rollout_manager`` both stand on it) and
it imports nothing of ours.
"""

from __future__ import annotations

import socket
from collections.abc import Collection
from typing import Any

__all__ = ["free_port", "pick_port", "dumps", "dumps_bytes", "loads"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; the caller binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pick_port(host: str, start: int = 0, count: int = 1, taken: Collection[int] = ()) -> int:
    """A port free on ``host`` now and not in ``taken``: the OS's pick (``start`` 0), or the lowest
    ``p >= start`` such that ``p .. p + count - 1`` are all free and none is taken."""
    if start == 0:
        for _ in range(100):
            p = free_port(host)
            if p not in taken:
                return p
        raise RuntimeError(f"no free port on {host} outside {len(taken)} taken ones")
    p = start
    while p + count <= 65536:
        block = range(p, p + count)
        busy = next((q for q in block if q in taken or not _bindable(host, q)), None)
        if busy is None:
            return p
        p = busy + 1
    raise RuntimeError(f"no {count} consecutive free ports on {host} from {start}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


try:  # orjson comes with sglang-router; it is several times faster on token-id lists
    import orjson

    def dumps(obj: Any) -> str:
        """``obj`` as a JSON string."""
        return orjson.dumps(obj).decode()

    dumps_bytes = orjson.dumps
    loads = orjson.loads
except ImportError:  # pragma: no cover
    import json

    def dumps(obj: Any) -> str:
        """``obj`` as a JSON string."""
        return json.dumps(obj)

    def dumps_bytes(obj: Any) -> bytes:
        """``obj`` as JSON bytes (a request or response body)."""
        return json.dumps(obj).encode()

    loads = json.loads
