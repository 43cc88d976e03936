"""A sandboxed Python tool for multi-turn rollouts: run model-written code in a subprocess, under limits.

Custom generate functions (and, later, agent environments) call it from the rollout manager's
event loop::

    from plugins.python_sandbox import SandboxLimits, run_python

    result = await run_python("print(6 * 7)")                      # ToolResult(stdout="42\\n", ...)
    result = await run_python(code, SandboxLimits(wall_s=3, memory_bytes=256 << 20))
    text = result.stdout if result.ok else result.stderr           # what the model sees next

What a call gets:

- a fresh ``python -I -u`` (isolated mode: no ``PYTHON*`` variables, no user site, not the script's
  directory on ``sys.path``) in its own session / process group, started with
  ``asyncio.create_subprocess_exec``: nothing waits on the event loop, which keeps serving the
  other samples while the code runs;
- a scrubbed environment (``PATH``, ``HOME``/``TMPDIR`` = the scratch directory, a UTF-8 locale and
  one-thread BLAS settings; nothing of the parent's: no API keys, tokens, ``RAY_*``, ``SGLANG_*``);
- an empty working directory, removed (with everything the code wrote) when the call ends;
- the limits of ``SandboxLimits`` (rlimits are set by a small bootstrap that then ``exec``s the code,
  so no ``preexec_fn`` runs in our threaded process);
- no network when a new network namespace can be made (``unshare --net``, or an unprivileged
  user namespace with ``--map-root-user``): probed once per process; without one a single warning
  is logged and ``ToolResult.network_isolated`` is False (``network="require"`` refuses instead);
- at a timeout, an output cap, a cancellation of the call, or simply when the code's main process
  ends, the whole process group is killed: children the code started do not outlive the call.

Not covered: a child that calls ``setsid()`` leaves the process group and survives the kill (a PID
namespace would catch it); the filesystem outside the scratch directory is readable and writable
as the rollout manager's user (no mount namespace / chroot). This bounds runaway code; it is not a
security boundary against hostile code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass

log = logging.getLogger(__name__)

__all__ = ["SandboxLimits", "ToolResult", "PythonSandbox", "run_python", "has_network_isolation"]

#: How long a killed process group may take to die and close its pipes before we stop reading.
_KILL_GRACE_S = 2.0

# Runs first in the sandbox process: applies the limits, then replaces itself with the code's
# interpreter (same pid, same process group, the limits inherited). An argument of -1 = not set.
_BOOTSTRAP = """\
import os, resource, sys
def cap(which, soft, hard):
    if soft < 0:
        return
    top = resource.getrlimit(which)[1]  # an unprivileged process cannot raise its hard limit
    if top != resource.RLIM_INFINITY:
        soft, hard = min(soft, top), min(hard, top)
    resource.setrlimit(which, (soft, hard))
cpu, mem, fsize, nproc = (int(a) for a in sys.argv[1:5])
cap(resource.RLIMIT_CORE, 0, 0)
cap(resource.RLIMIT_CPU, cpu, cpu + 1)  # SIGXCPU at the soft limit; SIGKILL 1 s later if caught
cap(resource.RLIMIT_AS, mem, mem)
cap(resource.RLIMIT_FSIZE, fsize, fsize)
cap(resource.RLIMIT_NPROC, nproc, nproc)
os.execv(sys.executable, [sys.executable, "-I", "-u", sys.argv[5]])
"""

_NETWORK_MODES = ("isolate", "require", "allow")


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one call. ``None`` leaves a limit unset (inherited from the rollout manager).

    - ``wall_s`` (10.0): wall-clock seconds of the process (time queued for a concurrency slot
      not counted); past it the process group is killed and ``timed_out`` is True.
    - ``cpu_s`` (5): CPU seconds (``RLIMIT_CPU``); the kernel ends the process with SIGXCPU,
      ``killed_reason == "cpu"``.
    - ``memory_bytes`` (1 GiB): address space (``RLIMIT_AS``); allocations past it fail, so the
      code sees ``MemoryError`` (exit code 1 unless it catches it). Importing big native libraries
      (torch) needs more than the default.
    - ``output_bytes`` (64 KiB): stdout and stderr are each kept up to this many bytes; one more
      byte and the process group is killed, ``truncated`` is True, ``killed_reason == "output"``.
    - ``file_size_bytes`` (16 MiB): the largest file the code may write (``RLIMIT_FSIZE``); a write
      past it fails with ``OSError: File too large``.
    - ``max_processes`` (None): ``RLIMIT_NPROC``. Off by default because Linux counts it per
      real user id: every process and thread of that user (the trainer, Ray, the engines) counts,
      so a small number makes the code's first fork fail and a large one bounds nothing; root
      (CAP_SYS_RESOURCE) is not held to it at all. Set it only when the sandbox runs as a user of
      its own.
    - ``network`` ("isolate"): "isolate" runs the code in a new network namespace when one can be
      made (otherwise with the network, one warning logged); "require" raises ``RuntimeError``
      when it cannot; "allow" never isolates.
    """

    wall_s: float = 10.0
    cpu_s: int | None = 5
    memory_bytes: int | None = 1 << 30
    output_bytes: int = 64 * 1024
    file_size_bytes: int | None = 16 << 20
    max_processes: int | None = None
    network: str = "isolate"

    def __post_init__(self):
        if isinstance(self.wall_s, bool) or not isinstance(self.wall_s, (int, float)) or not self.wall_s > 0:
            raise ValueError(f"SandboxLimits.wall_s must be a number > 0, got {self.wall_s!r}")
        for name in ("cpu_s", "memory_bytes", "output_bytes", "file_size_bytes", "max_processes"):
            value = getattr(self, name)
            if value is None and name != "output_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SandboxLimits.{name} must be an int >= 1"
                                 f"{'' if name == 'output_bytes' else ' or None'}, got {value!r}")
        if self.network not in _NETWORK_MODES:
            raise ValueError(f"SandboxLimits.network must be one of {_NETWORK_MODES}, got {self.network!r}")


@dataclass(frozen=True)
class ToolResult:
    """What one call produced.

    ``exit_code`` is the process's: 0 success, 1 an uncaught exception, negative a signal
    (``-signal.SIGKILL`` after our kill). ``killed_reason``: None (the code ended by itself),
    "timeout", "output" (over ``output_bytes``), "cpu" (``RLIMIT_CPU``), or "signal NAME" for any
    other fatal signal (a cancelled call kills the code and raises ``CancelledError``). ``wall_s`` is the process's wall
    time; ``network_isolated`` says whether it ran without network.
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    killed_reason: str | None
    wall_s: float
    truncated: bool
    network_isolated: bool

    @property
    def ok(self) -> bool:
        """True when the code ran to completion with exit code 0 and nothing was cut."""
        return self.exit_code == 0 and self.killed_reason is None and not self.truncated


# --- network isolation: probed once per process --------------------------------------------------

_netns_prefix: list[str] | None = None  # the command prefix that isolates; [] when none works


async def _probe_netns(python: str) -> list[str]:
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    # Proof, not just an exit code: inside, the only interface must be the (down) loopback.
    check = "import socket, sys; sys.exit([n for _, n in socket.if_nameindex()] != ['lo'])"
    for prefix in ([unshare, "--net", "--"], [unshare, "--map-root-user", "--net", "--"]):
        try:
            proc = await asyncio.create_subprocess_exec(
                *prefix, python, "-I", "-c", check, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, env=_base_env("/"))
        except OSError:
            continue
        try:
            if await asyncio.wait_for(proc.wait(), 10) == 0:
                return prefix
        except asyncio.TimeoutError:
            proc.kill()
    return []


async def _network_prefix(python: str) -> list[str]:
    global _netns_prefix
    if _netns_prefix is None:
        found = await _probe_netns(python)
        if _netns_prefix is None:  # another call may have finished its probe first: warn once
            _netns_prefix = found
            if not found:
                log.warning("python sandbox: cannot create a network namespace (unshare --net, with or "
                            "without --map-root-user): sandboxed code runs WITH network access")
    return _netns_prefix


async def has_network_isolation() -> bool:
    """Whether this machine lets the sandbox run code in a network namespace of its own (probed once)."""
    return bool(await _network_prefix(sys.executable))


# --- the sandbox ---------------------------------------------------------------------------------

def _base_env(home: str) -> dict[str, str]:
    # Built from nothing, never filtered from os.environ: a secret with an unforeseen name cannot leak.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home,
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            # one BLAS thread: thread pools reserve address space that RLIMIT_AS counts
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class _Protocol(asyncio.subprocess.SubprocessStreamProtocol):
    """create_subprocess_exec's protocol, plus an event set when the process itself has exited:
    ``Process.wait()`` also waits for the pipes to close, which a leftover child holding them
    would delay until the wall limit."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.exited = asyncio.Event()

    def process_exited(self) -> None:
        super().process_exited()
        self.exited.set()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


class PythonSandbox:
    """Runs code under ``limits`` (the default of each call), at most ``max_concurrency`` calls at a
    time per event loop (the others wait for a slot). ``python`` is the interpreter (default: ours,
    so the code sees the same installed packages). One instance may serve several loops."""

    def __init__(self, limits: SandboxLimits | None = None, max_concurrency: int = 4,
                 python: str = sys.executable):
        if limits is not None and not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        self.limits = limits or SandboxLimits()
        self.max_concurrency = max_concurrency
        self.python = python
        # An asyncio.Semaphore belongs to the loop it first waits on: one per loop.
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        with self._lock:
            sem = self._semaphores.get(loop)
            if sem is None:
                sem = self._semaphores[loop] = asyncio.Semaphore(self.max_concurrency)
            return sem

    async def run(self, code: str, limits: SandboxLimits | None = None) -> ToolResult:
        """Run ``code`` (Python source) and return its ``ToolResult``. Raises ``TypeError`` for code
        that is not a str or limits that are not ``SandboxLimits``; the code's own failures
        (syntax errors, exceptions, limits hit) are results, not exceptions."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str of Python source, got {type(code).__name__}")
        if limits is None:
            limits = self.limits
        elif not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        prefix = [] if limits.network == "allow" else await _network_prefix(self.python)
        if limits.network == "require" and not prefix:
            raise RuntimeError("python sandbox: network='require' but no network namespace can be made here")
        async with self._semaphore():
            return await self._run(code, limits, prefix)

    async def _run(self, code: str, limits: SandboxLimits, prefix: list[str]) -> ToolResult:
        # Tiny synchronous file work (a directory, one small file): not worth a thread hop.
        root = tempfile.mkdtemp(prefix="reservoir-sandbox-")
        try:
            work = os.path.join(root, "work")
            os.mkdir(work)
            script = os.path.join(root, "main.py")  # outside the working directory, which stays empty
            # surrogatepass: undecodable model text becomes the code's SyntaxError, not ours
            with open(script, "w", encoding="utf-8", errors="surrogatepass") as f:
                f.write(code)
            num = [-1 if v is None else v for v in
                   (limits.cpu_s, limits.memory_bytes, limits.file_size_bytes, limits.max_processes)]
            return await self._supervise(
                [*prefix, self.python, "-I", "-c", _BOOTSTRAP, *map(str, num), script],
                work, limits, bool(prefix))
        finally:
            await asyncio.to_thread(shutil.rmtree, root, True)

    async def _supervise(self, argv: list[str], work: str, limits: SandboxLimits,
                         isolated: bool) -> ToolResult:
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        transport, protocol = await loop.subprocess_exec(
            lambda: _Protocol(limit=1 << 16, loop=loop),
            *argv, cwd=work, env=_base_env(work), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True)  # its own process group (pgid = pid): one killpg ends all of it
        proc = asyncio.subprocess.Process(transport, protocol, loop)  # what create_subprocess_exec builds
        reason: list[str] = []  # the first reason we killed it

        def kill(why: str) -> None:
            if not reason:
                reason.append(why)
            _kill_group(proc.pid)

        async def pump(stream: asyncio.StreamReader, buf: bytearray) -> bool:
            while chunk := await stream.read(1 << 16):
                room = limits.output_bytes - len(buf)
                if len(chunk) > room:  # capped while reading: never more than the cap in memory
                    buf += chunk[:room]
                    kill("output")
                    return True
                buf += chunk
            return False

        out, err = bytearray(), bytearray()
        pumps = [asyncio.ensure_future(pump(proc.stdout, out)), asyncio.ensure_future(pump(proc.stderr, err))]
        exited = asyncio.ensure_future(protocol.exited.wait())
        try:
            await asyncio.wait([exited], timeout=limits.wall_s)
            if not exited.done():
                kill("timeout")
                await asyncio.wait([exited], timeout=_KILL_GRACE_S)
            wall = time.monotonic() - start
            # The main process has ended: whatever it started goes too (and closes the pipes it
            # holds, so reading ends now rather than at the wall limit). The group id stays
            # reserved while any member lives; once none does, only a new group leader that got
            # the same pid in the microseconds since could be hit: a race we accept.
            _kill_group(proc.pid)
            await asyncio.wait(pumps, timeout=_KILL_GRACE_S)
        except BaseException:  # cancelled (e.g. the custom generate's timeout): no orphans left
            kill("cancelled")
            raise
        finally:
            for t in (*pumps, exited):
                t.cancel()  # only a process that escaped the group (setsid) can keep them running
            transport.close()  # our ends of the pipes, even if such a process still holds theirs
        truncated = any(t.done() and not t.cancelled() and t.result() for t in pumps)
        code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        if not reason and code < 0:
            sig = -code
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = str(sig)
            reason.append("cpu" if sig == signal.SIGXCPU else f"signal {name}")
        return ToolResult(stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
                          exit_code=code, timed_out=reason[:1] == ["timeout"],
                          killed_reason=reason[0] if reason else None, wall_s=wall,
                          truncated=truncated, network_isolated=isolated)


_default: PythonSandbox | None = None


async def run_python(code: str, limits: SandboxLimits | None = None) -> ToolResult:
    """Run ``code`` in the process-wide default ``PythonSandbox`` (``SandboxLimits()`` defaults, at
    most 4 calls at a time per event loop). Make a ``PythonSandbox`` of your own for other bounds."""
    global _default
    if _default is None:
        _default = PythonSandbox()
    return await _default.run(code, limits)
