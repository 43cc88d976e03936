"""Settings of the embedded engine: one dataclass shared by ``__main__``, the Ray actor and the
subprocess launcher. Flag names follow SGLang's server arguments wherever SGLang has one.
Each field declares its flag (:func:`flags.flag`: default, help, choices in one place), as every
part's settings do; ``python -m embedded_engine``'s parser is made from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from flags import SettingError, add_flags, check_bound, check_choice, flag, flag_fields, flag_name, from_args
from flags.parser import ArgumentParser
from sglang_protocol.dtype import serving_dtype

# The keys travel to an engine subprocess in its environment, never on its command line (which
# any local user can read in ``ps``); the flags are SGLang's and still accepted.
KEY_ENV = {"api_key": "RESERVOIR_ENGINE_API_KEY", "admin_api_key": "RESERVOIR_ENGINE_ADMIN_API_KEY"}
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")  # SGLang's: the checkpoint's weights, or random ones of the config's shapes
NATIVE_FORWARD = ("auto", "off")


@dataclass
class EngineSettings:
    """How to run one embedded engine (see ``python -m embedded_engine --help``)."""

    model_path: str = flag(help="HF checkpoint directory (weights, config, tokenizer)")
    tokenizer_path: str | None = flag(None, "tokenizer directory (default: --model-path)")
    host: str = flag("127.0.0.1", "address the HTTP server listens on")
    port: int = flag(30000, "port the HTTP server listens on (0: a free one)")
    device: str = flag("cpu", "cpu or cuda[:i]")
    dtype: str = flag("auto", "auto (CUDA: SGLang's rule, the config's dtype with float32 served as float16; CPU: float32), "
                      "float32, bfloat16, float16", choices=DTYPES)
    load_format: str = flag("auto", "auto: the checkpoint's weights; dummy: random weights of the config's shapes "
                            "(SGLang's; for benchmarks and tests that push their own weights)", choices=LOAD_FORMATS)
    custom_weight_loader: str = flag("", "SGLang's: import paths of functions fn(model, named_tensors) that "
                                     "/update_weights_from_tensor may name as its load_format (e.g. "
                                     "sglang_protocol.held_weights.load_and_hold); several: space- or comma-separated",
                                     nargs="*")
    max_running_requests: int = flag(128, "most requests decoded together in one batch (rows of the running batch)")
    max_prefill_tokens: int = flag(8192, "most prompt tokens prefilled (admitted) in one scheduler step")
    context_length: int | None = flag(None, "longest prompt+output (default: the model's max_position_embeddings)")
    random_seed: int | None = flag(None, "seed for requests without a sampling_seed")
    weight_version: str = flag("default", "initial weight version reported in meta_info (SGLang's)")
    num_threads: int | None = flag(None, "torch intra-op threads (default: torch's)")
    served_model_name: str | None = flag(None, "the model name /v1/models and /server_info report (default: --model-path)")
    native_forward: str = flag("auto", "auto: the engine's own forward for Llama/Qwen2/Qwen3/Mistral (else "
                               "transformers'); off: always transformers' modules", choices=NATIVE_FORWARD)
    weight_update_timeout_s: float = flag(600.0, "seconds to join, or receive, a weight broadcast")
    weight_update_connect_timeout_s: float = flag(30.0, "seconds to reach the trainer's weight-update rendezvous")
    weight_update_masters: str = flag("", "comma-separated trainer addresses /init_weights_update_group may join "
                                      "besides loopback ones (multi-node: trainer rank 0's node IP; access.py)")
    weight_update_dirs: str = flag("", "comma-separated directories /update_weights_from_disk may load from, besides "
                                   "--model-path (no Hub downloads; access.py)")
    api_key: str | None = flag(None, "SGLang's --api-key: requests need 'Authorization: Bearer KEY' (health probes "
                               f"excepted; default: ${KEY_ENV['api_key']}; auth.py)")
    admin_api_key: str | None = flag(None, "SGLang's --admin-api-key: the control routes (pause, weight updates, "
                                     f"memory) need this key (default: ${KEY_ENV['admin_api_key']}; auth.py)")
    enable_lora: bool = flag(False, "SGLang's: serve LoRA adapters (/load_lora_adapter, /load_lora_adapter_from_tensors, "
                             "/unload_lora_adapter; a /generate names one with lora_path; embedded_engine/lora.py)")
    max_lora_rank: int | None = flag(None, "SGLang's: the largest adapter rank that loads (default: any)")
    lora_target_modules: str = flag("", "SGLang's: modules adapters may target, e.g. q_proj v_proj, or all "
                                    "(default: any module of the model); space- or comma-separated", nargs="*")
    log_level: str = flag("info", "Python logging level")
    extra: dict = field(default_factory=dict)  # free-form, reported in /server_info (no flag)

    def __post_init__(self) -> None:
        if not self.model_path:
            raise SettingError("model_path", "{model_path} is required")
        self.model_path = os.path.abspath(self.model_path)  # the router loads the tokenizer from it
        if self.tokenizer_path is not None:
            self.tokenizer_path = os.path.abspath(self.tokenizer_path)
        check_choice(self, "dtype", DTYPES)
        check_choice(self, "load_format", LOAD_FORMATS)
        check_choice(self, "native_forward", NATIVE_FORWARD)
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise SettingError("device", "{device}=" + f"{self.device!r}: expected cpu or cuda[:i]")
        check_bound(self, ">=", 1, "max_running_requests", "max_prefill_tokens")
        check_bound(self, ">=", 2, "context_length")
        check_bound(self, ">=", 1, "max_lora_rank")
        if (self.max_lora_rank is not None or self.lora_target_modules) and not self.enable_lora:
            raise SettingError(("max_lora_rank", "lora_target_modules"), "need {enable_lora}")
        if not 0 <= self.port < 65536:
            raise SettingError("port", "{port}=" + f"{self.port} is out of range")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def torch_dtype_name(self, config: dict | None = None) -> str:
        """The dtype the engine serves in. ``auto``: on CUDA, SGLang's own rule on the model's
        config (``sglang_protocol.dtype``: a float32 checkpoint is served as float16), so a run
        with the embedded engine serves what one with SGLang would; on the CPU, float32 (half
        precision there is slow, and the CPU tier compares log-probs exactly)."""
        if self.dtype != "auto":
            return self.dtype
        if self.device == "cpu":
            return "float32"
        return serving_dtype("auto", config or {}) or "bfloat16"

    def weight_loaders(self) -> list[str]:
        """``--custom-weight-loader``'s import paths (SGLang's flag takes several: space- or
        comma-separated here)."""
        return self.custom_weight_loader.replace(",", " ").split()

    def lora_modules(self) -> list[str] | None:
        """``--lora-target-modules``' names; None: any module (SGLang's ``all``, or the flag unset)."""
        names = self.lora_target_modules.replace(",", " ").split()
        return None if not names or names in (["all"], ["all-linear"]) else names

    def to_cli(self) -> list[str]:
        """The command-line flags that reproduce these settings (for the subprocess launcher),
        keys aside: :meth:`key_env` carries them."""
        out: list[str] = []
        for f, _ in flag_fields(type(self)):
            v = getattr(self, f.name)
            if f.name in KEY_ENV or v is None or v == f.default:
                continue
            out += [flag_name(f)] if v is True else [flag_name(f), str(v)]
        return out

    def key_env(self) -> dict[str, str]:
        """The environment that gives an engine subprocess these settings' keys."""
        return {env: getattr(self, name) for name, env in KEY_ENV.items() if getattr(self, name)}


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m embedded_engine``: a flag for each field of :class:`EngineSettings`
    (SGLang's names; no abbreviations: a prefix of a flag is an error, not that flag)."""
    ap = ArgumentParser(prog="python -m embedded_engine", allow_abbrev=False,
                        description="Embedded inference engine speaking SGLang's native HTTP API.")
    add_flags(ap, EngineSettings)
    return ap


def parse_settings(argv: list[str] | None = None) -> EngineSettings:
    """Parse the command line into EngineSettings; a bad flag exits with a usage error naming it."""
    ap = build_parser()
    ns = ap.parse_args(argv)
    keys = {name: os.environ[env] for name, env in KEY_ENV.items()  # a flag wins over the environment
            if getattr(ns, name) is None and os.environ.get(env)}
    try:
        loaders = ns.custom_weight_loader  # SGLang's flag takes several paths; the field holds them as one string
        modules = ns.lora_target_modules  # the same for SGLang's list of module names
        return from_args(EngineSettings, ns, custom_weight_loader=loaders if isinstance(loaders, str) else " ".join(loaders),
                         lora_target_modules=modules if isinstance(modules, str) else " ".join(modules), **keys)
    except ValueError as e:  # a usage error, not a crash: the parser prints it and exits with 2
        ap.error(str(e))
