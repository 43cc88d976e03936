"""Settings of the embedded engine: one dataclass shared by ``__main__``, the Ray actor and the
subprocess launcher. Flag names follow SGLang's server arguments wherever SGLang has one.
Every default lives here, in the dataclass; the CLI parser reads them from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field


# The keys travel to an engine subprocess in its environment, never on its command line (which
# any local user can read in ``ps``); the flags are SGLang's and still accepted.
KEY_ENV = {"api_key": "RESERVOIR_ENGINE_API_KEY", "admin_api_key": "RESERVOIR_ENGINE_ADMIN_API_KEY"}


@dataclass
class EngineSettings:
    """How to run one embedded engine (see ``python -m embedded_engine --help``)."""

    model_path: str
    tokenizer_path: str | None = None  # None: the model path
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "cpu"  # "cpu" or "cuda[:i]"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    load_format: str = "auto"  # SGLang's: auto (the checkpoint's weights) or dummy (random, config only)
    custom_weight_loader: str = ""  # SGLang's: import paths /update_weights_from_tensor may name as load_format
    max_running_requests: int = 128  # rows of the running batch
    max_prefill_tokens: int = 8192  # prompt tokens admitted (prefilled) in one step
    context_length: int | None = None  # None: the model config's max_position_embeddings
    random_seed: int | None = None  # seeds sampling of requests without a sampling_seed
    weight_version: str = "default"  # SGLang's initial weight version
    num_threads: int | None = None  # torch intra-op threads (None: torch's default)
    served_model_name: str | None = None
    native_forward: str = "auto"  # auto: the engine's own forward for llama-family models; off: transformers'
    weight_update_timeout_s: float = 600.0  # bound on joining / receiving a weight broadcast
    weight_update_connect_timeout_s: float = 30.0  # bound on reaching the trainer's rendezvous
    weight_update_masters: str = ""  # comma-separated non-loopback master addresses allowed (access.py)
    weight_update_dirs: str = ""  # comma-separated directories /update_weights_from_disk may load (access.py)
    api_key: str | None = None  # SGLang's --api-key (auth.py)
    admin_api_key: str | None = None  # SGLang's --admin-api-key (auth.py)
    log_level: str = "info"
    extra: dict = field(default_factory=dict)  # free-form, reported in /server_info

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("--model-path is required")
        self.model_path = os.path.abspath(self.model_path)  # the router loads the tokenizer from it
        if self.tokenizer_path is not None:
            self.tokenizer_path = os.path.abspath(self.tokenizer_path)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype {self.dtype!r}: expected auto, float32, bfloat16 or float16")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format {self.load_format!r}: expected auto or dummy")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"--device {self.device!r}: expected cpu or cuda[:i]")
        if self.native_forward not in ("auto", "off"):
            raise ValueError(f"--native-forward {self.native_forward!r}: expected auto or off")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.max_prefill_tokens < 1:
            raise ValueError("--max-prefill-tokens must be >= 1")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError("--context-length must be >= 2")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port {self.port} is out of range")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    def weight_loaders(self) -> list[str]:
        """``--custom-weight-loader``'s import paths (SGLang's flag takes several: space- or
        comma-separated here)."""
        return self.custom_weight_loader.replace(",", " ").split()

    def to_cli(self) -> list[str]:
        """The command-line flags that reproduce these settings (for the subprocess launcher),
        keys aside: :meth:`key_env` carries them."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "extra" or f.name in KEY_ENV or v is None or v == f.default:
                continue
            out += ["--" + f.name.replace("_", "-"), str(v)]
        return out

    def key_env(self) -> dict[str, str]:
        """The environment that gives an engine subprocess these settings' keys."""
        return {env: getattr(self, name) for name, env in KEY_ENV.items() if getattr(self, name)}


_HELP = {
    "model_path": "HF checkpoint directory (weights, config, tokenizer)",
    "tokenizer_path": "tokenizer directory (default: --model-path)",
    "device": "cpu or cuda[:i]",
    "dtype": "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16",
    "load_format": "auto: the checkpoint's weights; dummy: random weights of the config's shapes (SGLang's; for "
                   "benchmarks and tests that push their own weights)",
    "custom_weight_loader": "SGLang's: import paths of functions fn(model, named_tensors) that "
                            "/update_weights_from_tensor may name as its load_format (e.g. "
                            "sglang_protocol.held_weights.load_and_hold)",
    "max_running_requests": "most requests decoded together in one batch",
    "max_prefill_tokens": "most prompt tokens prefilled in one scheduler step",
    "context_length": "longest prompt+output (default: the model's max_position_embeddings)",
    "random_seed": "seed for requests without a sampling_seed",
    "weight_version": "initial weight version reported in meta_info",
    "num_threads": "torch intra-op threads",
    "weight_update_connect_timeout_s": "seconds to reach the trainer's weight-update rendezvous",
    "weight_update_masters": "comma-separated trainer addresses /init_weights_update_group may join besides "
                             "loopback ones (multi-node: trainer rank 0's node IP)",
    "weight_update_dirs": "comma-separated directories /update_weights_from_disk may load from, besides "
                          "--model-path (no Hub downloads)",
    "api_key": "SGLang's --api-key: requests need 'Authorization: Bearer KEY' (health probes excepted)",
    "admin_api_key": "SGLang's --admin-api-key: the control routes (pause, weight updates, memory) need this key",
    # (both also read from $RESERVOIR_ENGINE_API_KEY / $RESERVOIR_ENGINE_ADMIN_API_KEY: see KEY_ENV)
    "native_forward": "auto: the engine's own forward for Llama/Qwen2/Qwen3/Mistral (else transformers'); "
                      "off: always transformers' modules",
}


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser whose flags are the dataclass fields (SGLang's names)."""
    ap = argparse.ArgumentParser(prog="python -m embedded_engine", allow_abbrev=False,
                                 description="Embedded inference engine speaking SGLang's native HTTP API.")
    for f in dataclasses.fields(EngineSettings):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        ftype = str(f.type)  # a string under `from __future__ import annotations`
        typ = int if ftype.startswith("int") else float if ftype.startswith("float") else str
        kw: dict = {"type": typ, "help": _HELP.get(f.name, "")}
        if f.default is dataclasses.MISSING:
            kw["required"] = True
        else:
            kw["default"] = f.default
        if f.name == "custom_weight_loader":  # SGLang's flag takes several paths
            kw["nargs"] = "*"
        ap.add_argument(flag, **kw)
    return ap


def parse_settings(argv: list[str] | None = None) -> EngineSettings:
    """Parse the command line into EngineSettings; a bad flag exits with a usage error naming it."""
    ap = build_parser()
    ns = ap.parse_args(argv)
    if isinstance(ns.custom_weight_loader, list):
        ns.custom_weight_loader = " ".join(ns.custom_weight_loader)
    for name, env in KEY_ENV.items():  # a flag wins over the environment
        if getattr(ns, name) is None and os.environ.get(env):
            setattr(ns, name, os.environ[env])
    try:
        return EngineSettings(**vars(ns))
    except ValueError as e:  # a usage error, not a crash: argparse prints it and exits with 2
        ap.error(str(e))
