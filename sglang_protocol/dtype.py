"""The dtype an SGLang server serves a model in: one rule for both sides, the weight sender (which
casts to it) and the embedded engine (which serves in it on CUDA, as SGLang would)."""

from __future__ import annotations

# SGLang's dtype names (srt/configs/model_config.py, _STR_DTYPE_TO_TORCH_DTYPE)
SGLANG_DTYPES = {"half": "float16", "float16": "float16", "float": "float32", "float32": "float32",
                 "bfloat16": "bfloat16"}


def serving_dtype(dtype: str, config: dict | None) -> str | None:
    """SGLang's ``--dtype`` rule (``_get_and_verify_dtype`` in srt/configs/model_config.py): a named
    dtype is served as named; ``auto`` serves the config's ``dtype`` / ``torch_dtype`` (none:
    float32), except that float32 is served as float16 (gemma models: bfloat16). None when it
    cannot be known (``auto`` without a config, a dtype SGLang does not name)."""
    dtype = dtype.lower()
    if dtype != "auto":
        return SGLANG_DTYPES.get(dtype)
    if config is None:
        return None
    config_dtype = SGLANG_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"))
    if config_dtype == "float32":
        return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"
    return config_dtype
