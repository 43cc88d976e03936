"""Shared fixtures of the weight_sync tests: the toy model, built once per session through the
same script users run (``scripts/make_toy_model.py``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]


def _make_toy_model_main():
    spec = importlib.util.spec_from_file_location("make_toy_model", _ROOT / "scripts" / "make_toy_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.main


@pytest.fixture(scope="session")
def ws_toy_model(tmp_path_factory) -> Path:
    """A tiny llama chat model (HF checkpoint directory)."""
    out = tmp_path_factory.mktemp("ws_toy") / "model"
    _make_toy_model_main()(["--out", str(out), "--num-train", "10", "--num-eval", "4"])
    return out
