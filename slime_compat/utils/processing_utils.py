"""``slime.utils.processing_utils``: tokenizers (text models; multimodal inputs are not supported)."""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=8)
def _tokenizer(name_or_path: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)


def load_tokenizer(name_or_path: str, **kwargs: Any) -> Any:
    """The HF tokenizer of ``name_or_path`` (cached: plugins call this per sample)."""
    return _tokenizer(name_or_path, bool(kwargs.get("trust_remote_code", False)))


def load_processor(name_or_path: str, **kwargs: Any) -> None:
    """slime returns a multimodal processor when the model has one; Reservoir's rollout is text-only."""
    return None


def encode_image_for_rollout_engine(image: Any) -> str:
    raise NotImplementedError("multimodal rollouts are not supported by Reservoir (docs/slime.md)")


def build_processor_kwargs(multimodal_inputs: dict | None = None) -> dict:
    raise NotImplementedError("multimodal rollouts are not supported by Reservoir (docs/slime.md)")
