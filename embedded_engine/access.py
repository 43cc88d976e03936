"""What the embedded engine's weight endpoints may reach (docs/security.md).

- ``/init_weights_update_group`` joins a rendezvous at the ``master_address`` it is given: only a
  loopback address, or one listed in ``--weight-update-masters`` (multi-node runs list trainer
  rank 0's node IP). Anything else could make the engine connect to, or (as rank 0) listen on,
  an address of the caller's choosing.
- ``/update_weights_from_disk`` loads only a local directory inside the model path or one of
  ``--weight-update-dirs`` (symlinks resolved first), never a Hub id: a caller cannot probe the
  file system or make the engine download.
Refusals are ``ValueError`` naming the field and the flag that would allow it (HTTP 400).
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


def split_list(value: str) -> list[str]:
    """A comma-separated flag value as its non-empty items."""
    return [v.strip() for v in value.split(",") if v.strip()]


def check_master_address(address: str, allowed: list[str]) -> None:
    """ValueError unless ``address`` is a loopback address or in ``allowed``."""
    host = address.strip("[]")
    if host == "localhost" or host in allowed:
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"master_address: {address!r} is not a loopback address; start the engine with "
                     f"--weight-update-masters {address} to let it join a trainer there")


def check_weights_dir(path: str, model_path: str, allowed: list[str]) -> Path:
    """The resolved directory ``path`` if it lies inside ``model_path`` or an ``allowed`` directory."""
    p = Path(path)
    if not p.is_absolute():
        raise ValueError(f"model_path: {path!r} is not an absolute local path (Hub ids are not loaded)")
    real = Path(os.path.realpath(p))
    roots = [Path(os.path.realpath(r)) for r in (model_path, *allowed)]
    if not any(real == r or r in real.parents for r in roots):
        raise ValueError(f"model_path: {path!r} is outside the model path and --weight-update-dirs "
                         f"({', '.join(map(str, roots))})")
    return real
