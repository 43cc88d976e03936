"""Real SGLang servers for the GPU tier (``tests/test_sglang_gpu.py``) and the benchmarks that run
against them: start one with ``python -m sglang.launch_server``, wait for it, stop it.

The flags the H200 bundle needs (``../shared/device/make_sglang_bundle.sh`` leaves FlashAttention-3
and flashinfer's prebuilt kernels out): ``BUNDLE_FLAGS``. The launcher passes the same ones as
``--sglang-attention-backend triton --sglang-sampling-backend pytorch --sglang-grammar-backend none``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE_FLAGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none")
LAUNCHER_FLAGS = ("--sglang-attention-backend", "triton", "--sglang-sampling-backend", "pytorch",
                  "--sglang-grammar-backend", "none")


def sglang_available() -> bool:
    """SGLang importable here and a CUDA GPU present (the GPU tier's precondition)."""
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None


def sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def start_sglang(model: Path, port: int, *extra: str, log: Path | None = None, timeout: float = 600.0,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m sglang.launch_server`` on ``model`` at 127.0.0.1:``port`` with the bundle's flags
    and ``extra``; returns once ``/health`` answers (RuntimeError with the log's tail if it exits).

    The server gets its gRPC port from us (``SGLANG_GRPC_PORT``), as the launcher's engines do
    (``rollout_manager.engines``): SGLang 0.5.15 otherwise listens on ``port`` + 10000 as well and
    refuses to start when that passes 65535 or is taken."""
    from embedded_engine.launch import wait_healthy
    from sglang_protocol.net import free_port

    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
           "--port", str(port), *BUNDLE_FLAGS, *extra]
    out = open(log, "w") if log is not None else subprocess.DEVNULL
    full_env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                "SGLANG_GRPC_PORT": str(free_port()), **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout, proc)
    except RuntimeError as e:
        stop_sglang(proc)
        tail = log.read_text()[-3000:] if log is not None else ""
        raise RuntimeError(f"SGLang: {e}: {' '.join(cmd)}\n{tail}") from None
    return proc


def stop_sglang(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (its scheduler and detokenizer children too), then SIGKILL."""
    import signal

    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
