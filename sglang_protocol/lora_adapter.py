"""LoRA adapters as SGLang loads them: peft's on-disk format, and the merged deltas they stand for.

The one home of the adapter format that the trainer writes (``weight_sync/lora.py``), the
embedded engine reads (``/load_lora_adapter``) and SGLang reads (its ``LoRAAdapter`` loads a peft
directory): ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...) and
``adapter_model.safetensors`` whose keys are peft's, e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (``[r, in]``) and ``...lora_B.weight``
(``[out, r]``). Module ``m`` with weight ``W`` then serves ``W + (lora_alpha / r) * B @ A``
(peft's ``scaling``; rsLoRA's ``lora_alpha / sqrt(r)`` when ``use_rslora``).

A ``/generate`` request names its adapter with ``lora_path`` = the adapter's ``lora_name``
(SGLang's ``LoRARegistry`` looks it up by name, 0.5.15.post1 to 0.5.23); :data:`POLICY_ADAPTER` is
the name the trainer's adapter is served under.

The routes ``/load_lora_adapter`` ``{lora_name, lora_path}``, ``/unload_lora_adapter``
``{lora_name}`` and ``/update_weight_version`` are the same from 0.5.15.post1 to 0.5.23;
``/load_lora_adapter_from_tensors`` is not, and :func:`tensors_load_request` writes its body for the
release an engine reports (``io_struct.LoadLoRAAdapterFromTensorsReqInput`` of each):

- 0.5.15(.post1): ``serialized_tensors``, one base64 ForkingPickler payload (a str) that every TP
  rank deserializes; no ``expected_checksums`` (an unknown field is dropped, so nothing is checked);
- 0.5.16: the same, plus ``expected_checksums`` ``{name: sha256 of the raw bytes}``;
- 0.5.17+: ``serialized_named_tensors``, a list with one payload per TP rank (each rank reads its own);
- before 0.5.22 the route has no ``@auth_level``, so it is a NORMAL endpoint: with ``--api-key`` it
  takes the API key, never the admin key; from 0.5.22 it is ADMIN_OPTIONAL like the other LoRA routes.

The payload is the same in all: ``{peft tensor name: tensor}`` pickled (``tensor_update.serialize``),
with ``config_dict`` the ``adapter_config.json`` object; only its CUDA tensors' device is named by
UUID for 0.5.17+ and by index before (:func:`cuda_device_by_uuid`).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, NamedTuple

import torch

#: The ``lora_name`` the policy's adapter is loaded under on every engine (and the rollout's ``lora_path``).
POLICY_ADAPTER = "policy"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


#: The first releases with each change of ``/load_lora_adapter_from_tensors`` (module docstring).
CHECKSUMS_SINCE = (0, 5, 16)
PER_RANK_SINCE = (0, 5, 17)
ADMIN_ROUTE_SINCE = (0, 5, 22)


def cuda_device_by_uuid(release: tuple[int, int, int] | None) -> bool:
    """Whether an engine of SGLang ``release`` (None: the embedded engine) reads a CUDA tensor's
    device as a UUID in ``/load_lora_adapter_from_tensors``: 0.5.17+ applies its UUID patch to torch's
    reductions before it deserializes the adapter (``deserialize_own_rank``); 0.5.15's route does not,
    and a UUID there kills the scheduler (``_new_shared_cuda`` gets a str; seen on the GPU, 2026-12-05),
    so the adapter goes with the device's index, which must name the same GPU in both processes."""
    return release is None or release >= PER_RANK_SINCE


class TensorsLoad(NamedTuple):
    """One ``/load_lora_adapter_from_tensors`` request: its JSON ``body``, and whether it is an
    admin call (sends the admin key) or a NORMAL one (the API key)."""

    body: dict[str, Any]
    admin: bool


def tensors_load_request(release: tuple[int, int, int] | None, lora_name: str, config: dict, payload: str,
                         tp_size: int, checksums: dict[str, str] | None = None) -> TensorsLoad:
    """The ``/load_lora_adapter_from_tensors`` request for an engine running SGLang ``release``
    (``EngineClient.sglang_release``; None: the newest form, the embedded engine's). ``payload``:
    the serialized ``{name: tensor}`` dict; ``checksums``: ``expected_checksums``, ValueError where
    the release cannot check them (before 0.5.16)."""
    body: dict[str, Any] = {"lora_name": lora_name, "config_dict": config}
    if release is None or release >= PER_RANK_SINCE:
        body["serialized_named_tensors"] = [payload] * tp_size
    else:
        body["serialized_tensors"] = payload
    if checksums is not None:
        if release is not None and release < CHECKSUMS_SINCE:
            raise ValueError(f"expected_checksums: SGLang {'.'.join(map(str, release))} does not check a LoRA "
                             f"adapter it loads from tensors ({'.'.join(map(str, CHECKSUMS_SINCE))}+ does)")
        body["expected_checksums"] = checksums
    return TensorsLoad(body, release is None or release >= ADMIN_ROUTE_SINCE)


def peft_config(rank: int, alpha: float, target_modules: list[str] | str, base_model: str | None = None) -> dict:
    """An ``adapter_config.json`` as peft writes it for a causal LM (the fields SGLang reads)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank), "lora_alpha": float(alpha),
            "lora_dropout": 0.0, "target_modules": target_modules, "bias": "none", "use_rslora": False,
            "base_model_name_or_path": base_model, "inference_mode": True, "fan_in_fan_out": False}


def write_adapter(path: str, config: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Write a peft adapter directory at ``path``; returns the bytes of its weights file."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    weights = os.path.join(path, WEIGHTS_FILE)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, weights)
    return os.path.getsize(weights)


def read_adapter(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, tensors)`` of the peft adapter directory ``path``; ValueError naming the file."""
    from safetensors.torch import load_file

    cfg_file, weights = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    for f in (cfg_file, weights):
        if not os.path.isfile(f):
            raise ValueError(f"lora_path: {f} does not exist (a peft adapter directory holds {CONFIG_FILE} and "
                             f"{WEIGHTS_FILE})")
    try:
        with open(cfg_file) as fh:
            config = json.load(fh)
        return config, load_file(weights)
    except (OSError, ValueError) as e:
        raise ValueError(f"lora_path: cannot read the adapter in {path}: {e}") from e


def scaling(config: dict) -> float:
    """peft's ``scaling`` of an adapter: ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA)."""
    r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def module_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module name (HF, e.g. model.layers.0.self_attn.q_proj): (A [r, in], B [out, r])}``;
    ValueError naming a key that is not peft's ``...lora_A.weight`` / ``...lora_B.weight``."""
    a: dict[str, torch.Tensor] = {}
    b: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        name = key.removeprefix(_PREFIX)
        for tag, into in ((".lora_A.weight", a), (".lora_B.weight", b)):
            if name.endswith(tag):
                into[name[:-len(tag)]] = t
                break
        else:
            raise ValueError(f"adapter tensor {key!r}: expected peft's <module>.lora_A.weight or .lora_B.weight")
    unpaired = sorted(set(a) ^ set(b))
    if unpaired:
        raise ValueError(f"adapter module {unpaired[0]!r}: has only one of lora_A and lora_B")
    return {m: (a[m], b[m]) for m in a}


def merged_deltas(config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
                  ) -> dict[str, torch.Tensor]:
    """``{HF weight name: scaling * B @ A}``, what the adapter adds to each target weight (float32
    products, then ``dtype``)."""
    s = scaling(config)
    return {f"{m}.weight": (s * (bm.float() @ am.float())).to(dtype) for m, (am, bm) in module_pairs(tensors).items()}


def module_suffixes(target_modules: Any) -> list[str] | None:
    """The module names a ``target_modules`` setting lists (None for peft's ``all-linear``)."""
    if target_modules in (None, "all-linear", "all", ["all-linear"], ["all"]):
        return None
    if isinstance(target_modules, str):
        return [m.strip() for m in target_modules.split(",") if m.strip()]
    return [str(m) for m in target_modules]
