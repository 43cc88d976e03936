"""The rollout side's tokenizer (``--hf-checkpoint``'s), loaded without importing torch where that
gives the very tokenizer ``AutoTokenizer`` would.

``transformers.AutoTokenizer`` imports the model configurations (``configuration_utils`` ->
``modeling_rope_utils``), which import torch: about 1.4 CPU-seconds in the rollout manager's
process, which otherwise needs no torch. When the checkpoint is a local directory whose
``tokenizer_config.json`` names the generic fast tokenizer class (``TokenizersBackend``, or
``PreTrainedTokenizerFast`` as transformers 4 saves it) with no custom code (``auto_map``), and its
``config.json``'s ``model_type`` is one for which ``AutoTokenizer`` keeps that class (listed in
:data:`GENERIC_CLASS_MODEL_TYPES`, each checked against ``AutoTokenizer`` in
tests/test_rollout_tokenizer.py), that class is loaded directly: the same object ``AutoTokenizer``
returns, without its imports. Anything else (a hub id, a model-specific class, remote code) goes
through ``AutoTokenizer`` as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The tokenizer classes a ``tokenizer_config.json`` names for a plain ``tokenizer.json`` (the name
#: transformers 5 saves, and the one transformers 4 saved, which 5 reads as the same class).
GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
#: ``config.json`` model types whose checkpoints ``AutoTokenizer`` loads with the generic class their
#: tokenizer config names (not in transformers' ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``, which
#: it overrides with a model-specific class): the toy model's and SmolLM2's. A type not listed only
#: costs the torch import, never a different tokenizer.
GENERIC_CLASS_MODEL_TYPES = frozenset({"llama"})


def generic_class_name(path: str | Path) -> str | None:
    """The generic fast class ``AutoTokenizer`` would load for the checkpoint ``path``, when it can
    be told from its files alone (see the module's docstring); else None."""
    d = Path(path)
    try:
        tok_config = json.loads((d / "tokenizer_config.json").read_text())
        model_config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):  # not a local checkpoint, or unreadable: AutoTokenizer says what is wrong
        return None
    if not (isinstance(tok_config, dict) and isinstance(model_config, dict)):
        return None
    name = tok_config.get("tokenizer_class")
    if name not in GENERIC_CLASSES or "auto_map" in tok_config or "auto_map" in model_config:
        return None
    if model_config.get("model_type") not in GENERIC_CLASS_MODEL_TYPES or not (d / "tokenizer.json").is_file():
        return None
    return name


def load_tokenizer(path: str | Path) -> Any:
    """``--hf-checkpoint``'s tokenizer: what ``AutoTokenizer.from_pretrained(path)`` returns,
    without importing torch when the checkpoint's files say which class that is."""
    if generic_class_name(path) is not None:
        # the public name of the generic fast class in transformers 4 and 5 (5: TokenizersBackend)
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
