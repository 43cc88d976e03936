"""Shared fixtures. Tests build tiny models in-process through the same script users run."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def toy_model_dir(tmp_path_factory) -> Path:
    """The toy chat model + arithmetic task (random weights), built once per test session."""
    from scripts import make_toy_model

    return make_toy_model.main(["--out", str(tmp_path_factory.mktemp("toy") / "model")])
