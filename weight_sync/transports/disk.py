"""Transport ``disk``: for engines that share no collective fabric with the trainer, only a
filesystem. A push writes the weights as an HF checkpoint (``weight_sync/disk.py``:
``<disk_dir>/weights_v<version>/``, renamed into place when complete), runs the optional
``post_write`` hook (slime's ``--custom-update-weight-post-write-path``), then POSTs
``/update_weights_from_disk`` to every engine. No weight-update session is opened around it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path
from typing import Callable

from sglang_protocol.buckets import dtype_name
from weight_sync import disk
from weight_sync.engines import EngineState, call_all
from weight_sync.interfaces import WeightSyncSettings
from weight_sync.transports.base import Mark, Payload, Progress, Resume, Transport

#: ``post_write(version_dir, engine_urls)``
PostWrite = Callable[[str, list[str]], None]


class DiskTransport(Transport):
    """An HF checkpoint per version, loaded by each engine from its path.

    ``post_write(version_dir, engine_urls)`` (slime's ``--custom-update-weight-post-write-path``,
    bound by ``weight_sync.arguments.load_post_write_hook``, given to ``WeightSender``) runs in a
    worker thread once a version's directory is complete, before any engine is asked to load it; if
    it raises, the push fails naming the flag and no engine loads that version."""

    sessions = False

    def __init__(self, settings: WeightSyncSettings, mark: Mark, post_write: PostWrite | None = None):
        super().__init__(settings, mark)
        self.post_write = post_write

    async def send(self, members: list[EngineState], payload: Payload, version: int, progress: Progress | None,
                   resume: Resume | None) -> float:
        """Write the checkpoint, run ``post_write``, then every engine loads it; returns the seconds
        the engines took to load it."""
        s = self.settings
        loop = asyncio.get_running_loop()
        # each tensor in the dtype it travels in (the engines' own, as the other transports cast): a bf16
        # engine reads half the bytes, and the same values it would have cast to on load
        dtypes = [dtype_name(t.dtype) for _, t in payload.named]
        for b in payload.buckets:
            for i, spec in zip(b.indices, b.specs):
                dtypes[i] = spec.dtype
        path = await loop.run_in_executor(None, functools.partial(
            disk.write_hf_checkpoint, payload.named, s.disk_dir, version, s.hf_checkpoint, s.disk_keep,
            dtypes=dtypes))
        await self._post_write(path, members, version)
        t = time.perf_counter()
        await call_all(members, lambda c: c.update_weights_from_disk(str(path), str(version),
                                                                      timeout=s.timeout_s),
                        "update_weights_from_disk")
        return time.perf_counter() - t

    async def _post_write(self, path: Path, members: list[EngineState], version: int) -> None:
        """Run ``post_write`` on a written version's directory (in a worker thread), if given."""
        if self.post_write is None:
            return
        urls = [e.url for e in members]
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.post_write, str(path), urls)
        except Exception as e:  # the user's hook: the engines must not load what it did not publish
            raise RuntimeError(f"push v{version}: --custom-update-weight-post-write-path failed on {path}: "
                               f"{type(e).__name__}: {e}") from e
