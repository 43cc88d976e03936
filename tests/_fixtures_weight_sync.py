"""Shared fixtures of the weight_sync tests: the toy model, built once per session through the
same script users run (``scripts/make_toy_model.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest


def _make_toy_model_main():
    from scripts import make_toy_model

    return make_toy_model.main


@pytest.fixture(scope="session")
def ws_toy_model(tmp_path_factory) -> Path:
    """A tiny llama chat model (HF checkpoint directory)."""
    out = tmp_path_factory.mktemp("ws_toy") / "model"
    _make_toy_model_main()(["--out", str(out), "--num-train", "10", "--num-eval", "4"])
    return out


def start_engines(model: Path, n: int, ports: list[int] | None = None, weight_update_dirs: str = "",
                  dtype: str = "auto") -> list[tuple]:
    """Start ``n`` embedded engines on ``model`` in parallel; [(Popen, url)]. The caller stops them.
    ``weight_update_dirs``: where ``/update_weights_from_disk`` may load from besides the model;
    ``dtype``: what they serve in (``auto``: float32 on the CPU)."""
    from concurrent.futures import ThreadPoolExecutor

    from embedded_engine.launch import launch_engine_process
    from embedded_engine.settings import EngineSettings

    ports = ports or [0] * n
    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(lambda p: launch_engine_process(
            EngineSettings(model_path=str(model), port=p, num_threads=1, max_running_requests=8,
                           weight_update_dirs=weight_update_dirs, dtype=dtype), timeout_s=120),
            ports))


def stop_engines(engines: list[tuple]) -> None:
    import signal

    for proc, _ in engines:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a test may have stopped it
            proc.kill()
        proc.wait(30)


def perturbed_model(model: Path, scale: float):
    """The toy model with every weight multiplied by ``scale`` (a stand-in for a trained version)."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    return m.eval()


def train_steps(model_dir: Path, steps: int, lr: float, seed: int = 0):
    """A real optimizer (Adam, fp32 master weights) on a real loss (next-token cross-entropy on
    random tokens) over the model in ``model_dir``: yields the model after each step."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        ids = torch.randint(3, model.config.vocab_size, (4, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        yield model
