"""LoRA on the torch train backend (peft): its flags, the wrapped model, the adapter's tensors.

With ``--lora-rank R > 0`` the torch backend wraps its HF model with peft's LoRA on
``--target-modules`` (miles' and verl's names: ``all-linear``, or a comma list such as
``q_proj,v_proj``). The base weights are frozen (no gradient, no optimizer state); only the
adapter's ``lora_A`` / ``lora_B`` train, in float32. After each step only the adapter travels to
the engines (``weight_sync/lora.py``), which serve the base model plus it under
``sglang_protocol.lora_adapter.POLICY_ADAPTER``; checkpoints hold the adapter and its optimizer
state only, and export it in peft's format. The Megatron backend refuses ``--lora-rank > 0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from flags import SettingError, flag

if TYPE_CHECKING:
    import torch

G_LORA = "train: LoRA (torch backend; only the adapter trains and travels to the engines)"


@dataclass
class LoraSettings:
    """The LoRA adapter the torch backend trains (off with ``rank`` 0)."""

    rank: int = flag(0, "LoRA rank (0: off, full-weight training); the base weights are frozen and only the adapter "
                     "trains, is pushed to the engines and is checkpointed", name="--lora-rank", group=G_LORA)
    alpha: float = flag(16.0, "LoRA alpha: the adapter's update is scaled by alpha / rank", name="--lora-alpha")
    dropout: float = flag(0.0, "dropout on the adapter's input while training, in [0, 1)", name="--lora-dropout")
    target_modules: str = flag("all-linear", "modules that get an adapter: all-linear (every linear layer but the "
                               "output head) or a comma list of module names, e.g. q_proj,k_proj,v_proj,o_proj",
                               name="--target-modules")

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise SettingError("rank", f"{{rank}}={self.rank} must be >= 0 (0: off)")
        if self.alpha <= 0:
            raise SettingError("alpha", f"{{alpha}}={self.alpha} must be > 0")
        if not 0 <= self.dropout < 1:
            raise SettingError("dropout", f"{{dropout}}={self.dropout} must be in [0, 1)")
        if not self.modules():
            raise SettingError("target_modules", "{target_modules} names no module")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def modules(self) -> list[str] | str:
        """peft's ``target_modules``: ``"all-linear"`` or the list of module names."""
        if self.target_modules.strip() in ("all-linear", "all"):
            return "all-linear"
        return [m.strip() for m in self.target_modules.split(",") if m.strip()]


def wrap(model: "torch.nn.Module", lora: LoraSettings) -> "torch.nn.Module":
    """``model`` (an HF causal LM) with peft's LoRA adapters; the base frozen, the adapter float32.
    A ``--target-modules`` name that matches no module of the model is a ValueError naming the flag."""
    from peft import LoraConfig, get_peft_model

    modules = lora.modules()
    if modules != "all-linear":
        present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = [m for m in modules if m not in present]
        if missing:
            raise ValueError(f"--target-modules: {missing[0]!r} matches no module of the model (it has e.g. "
                             f"{', '.join(sorted(n for n in present if n.endswith('proj'))[:8]) or 'none'})")
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=modules,
                        task_type="CAUSAL_LM", bias="none")
    peft_model = get_peft_model(model, config)
    for p in peft_model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # the adapter's masters and optimizer state in float32
    return peft_model


def adapter_config(model: "torch.nn.Module", base_model: str | None = None) -> dict:
    """The adapter's ``adapter_config.json`` (peft's, as ``save_pretrained`` writes it)."""
    cfg = model.peft_config["default"].to_dict()
    cfg.update(base_model_name_or_path=base_model, inference_mode=True)
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}  # JSON: sets as sorted lists


def adapter_tensors(model: "torch.nn.Module") -> dict[str, "torch.Tensor"]:
    """The adapter's tensors under peft's saved names (``base_model.model.<module>.lora_A.weight``)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def base_hf_weights(model: "torch.nn.Module") -> Iterator[tuple[str, "torch.Tensor"]]:
    """The frozen base weights under their HF names (what an engine loads from ``--hf-checkpoint``)."""
    for name, p in model.get_base_model().named_parameters():
        if "lora_" in name:
            continue
        yield name.replace(".base_layer.", "."), p.detach()
