"""Fixtures of the embedded-engine tests: a toy model and engine subprocesses started the way
users start them (``launch_engine_process`` runs ``python -m embedded_engine``).

Tests that open sockets must run inside a loopback-only network namespace (as CI does):
``unshare -n bash -c 'ip link set lo up && exec pytest -q tests/test_engine_*.py'``.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any, Awaitable, Iterator

import pytest


def make_toy_model(out: Path, *extra: str) -> Path:
    """Build the toy model through scripts/make_toy_model.py's main (the users' code path)."""
    from scripts import make_toy_model

    return make_toy_model.main(["--out", str(out), "--num-train", "10", "--num-eval", "4", *extra])


@pytest.fixture(scope="session")
def engine_model(tmp_path_factory) -> Path:
    """The toy llama chat model (random weights, seed 0)."""
    return make_toy_model(tmp_path_factory.mktemp("engine_toy") / "model")


@pytest.fixture(scope="session")
def engine_model_b(tmp_path_factory) -> Path:
    """The same architecture with other weights (seed 1): the target of weight updates."""
    return make_toy_model(tmp_path_factory.mktemp("engine_toy_b") / "model", "--seed", "1")


def start_engine(model: Path, **settings: Any) -> tuple[subprocess.Popen, str]:
    """An engine subprocess on a free port. One torch thread by default: on a loaded 2-core
    machine several multi-threaded processes spin against each other (10-100x slower)."""
    from embedded_engine import EngineSettings, launch_engine_process

    settings.setdefault("num_threads", 1)
    return launch_engine_process(EngineSettings(model_path=str(model), port=0, **settings), timeout_s=180)


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture(scope="session")
def engine_url(engine_model) -> Iterator[str]:
    """One engine subprocess (seed 0) shared by the engine tests (tests that change its weights
    restore them before they end)."""
    from sglang_protocol.held_weights import LOADER

    proc, url = start_engine(engine_model, random_seed=0, custom_weight_loader=LOADER)  # as a run starts them
    try:
        yield url
    finally:
        stop_process(proc)


def run(coro: Awaitable[Any], timeout: float = 120.0) -> Any:
    """Run a coroutine to completion with a bound (no test can hang)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype="float32").eval()


def reference_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """Log-probs of ``response`` under a full forward over prompt+response (SGLang's definition:
    log_softmax(logits / temperature), temperature 1 for greedy), on the model's device."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([prompt + response], device=device)  # [1, P+R]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]  # [R, V]
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [R, V]
    return lp.gather(1, ids[0, len(prompt):, None]).squeeze(1).tolist()


def write_weights(params: dict, new: dict, how: str) -> None:
    """Write ``new`` into the engine's ``params`` the ways engine/weights.py (and disk loads) do:
    ``foreach_flat`` (one fused copy on flat views), ``copy`` (per tensor) or ``data`` (new storage)."""
    import torch

    with torch.no_grad():
        if how == "foreach_flat":
            torch._foreach_copy_([params[n].view(-1) for n in new], [t.reshape(-1) for t in new.values()])
        elif how == "copy":
            for n, t in new.items():
                params[n].copy_(t)
        else:
            for n, t in new.items():
                params[n].data = t.detach().clone()


def greedy_taker(seqs: list[list[int]], lps: list[list[float]]):
    """``take(logits, batch, rows)`` for runner-level tests: feeds each row its greedy token and
    appends the token to ``seqs[i]`` and its log-prob to ``lps[i]`` (``rows[j]`` = request of row j)."""
    import torch

    def take(logits, batch, rows) -> None:
        tok = logits.argmax(-1)  # [B]
        batch.last_tok = tok
        for j, (i, t) in enumerate(zip(rows, tok.tolist())):
            seqs[i].append(t)
            lps[i].append(torch.log_softmax(logits[j], -1)[t].item())

    return take
