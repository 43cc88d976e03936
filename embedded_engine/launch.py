"""Start the embedded engine as a subprocess (``python -m embedded_engine``)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from sglang_protocol.net import free_port

from .settings import EngineSettings

_REPO_ROOT = str(Path(__file__).resolve().parents[2])


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url/health`` until it answers 200; RuntimeError on timeout or if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"engine process exited with code {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"engine at {url} not healthy after {timeout_s:.0f}s")


def launch_engine_process(settings: EngineSettings, timeout_s: float = 300.0,
                          log_path: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start an engine subprocess and wait until ``/health`` answers. Returns (process, url).

    ``settings.port == 0`` picks a free port. Output goes to ``log_path`` (default: a temp file
    whose path is in the error message if start-up fails). The caller terminates the process.
    """
    if settings.port == 0:
        settings = dataclasses.replace(settings, port=free_port(settings.host))
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"engine-{settings.port}-", suffix=".log")
        os.close(fd)
    env = dict(os.environ)
    env["PYTHONPATH"] = _REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(settings.key_env())
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "embedded_engine", *settings.to_cli()],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=_REPO_ROOT)
    try:
        wait_healthy(settings.url, timeout_s, proc)
    except RuntimeError as e:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        tail = Path(log_path).read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{e}; log {log_path}:\n{tail}") from None
    return proc, settings.url
