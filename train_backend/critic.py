"""PPO's critic for the torch backend (``--advantage-estimator ppo``): a second HF model (of
``--critic-load``, default ``--hf-checkpoint``) without its LM head, with a scalar value head on
its last hidden state, its own AdamW (``--critic-lr``, the policy's schedule shape) and the clipped
value loss (:func:`~train_backend.losses.value_loss`).

A train step (:func:`train_backend.step.run_train_step`) asks :meth:`TorchCritic.values` for the
values of each sample's response tokens before any update (GAE's ``V``, and the value loss's old
values), then :meth:`TorchCritic.train` fits them to GAE's returns over the same optimizer steps
as the policy. The value of response token ``t`` is read where the policy's logits predicting
``t`` are (the state before ``t``), as in slime's ``get_values`` and OpenRLHF's critic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from buffer.sample import Sample
from train_backend.batching import PackedMicroBatch, plan_micro_batches
from train_backend.losses import LossDenominators, aggregate, value_loss
from train_backend.schedule import lr_factor
from train_backend.settings import TrainSettings


class ValueModel(torch.nn.Module):
    """An HF base model (``AutoModel``: the decoder without its LM head) and a scalar value head."""

    def __init__(self, backbone: torch.nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        # zero-initialised: every value starts at 0, so the first advantages are the rewards
        # themselves and no random head adds noise to them (slime re-initialises its critic head too)
        self.value_head = torch.nn.Linear(backbone.config.hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """Values of every position of the packed rows: ``[R, T]`` (float32)."""
        hidden = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        return self.value_head(hidden.float()).squeeze(-1)  # [R, T]


class TorchCritic:
    """The value model, its optimizer and its schedule, on the backend's device. ``pack`` packs
    samples into a micro-batch as the backend does (rows, padding id, device); ``autocast`` is the
    backend's compute-dtype context."""

    def __init__(self, settings: TrainSettings, device: torch.device, pack: Callable[[list[Sample]], PackedMicroBatch],
                 autocast: Callable[[], Any]) -> None:
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        self.settings = settings
        self.pack = pack
        self.autocast = autocast
        # a causal LM checkpoint's LM head is left out on purpose: not the load report's warning
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            backbone = AutoModel.from_pretrained(settings.critic_load or settings.hf_checkpoint, dtype=torch.float32)
        finally:
            hf_logging.set_verbosity(verbosity)
        self.model = ValueModel(backbone).to(device)
        self.model.train()
        lr = settings.critic_lr if settings.critic_lr is not None else settings.lr
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(settings.adam_beta1, settings.adam_beta2),
                                           eps=settings.adam_eps, weight_decay=settings.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(settings))

    def _micro_batches(self, samples: list[Sample]) -> list[list[int]]:
        return plan_micro_batches([len(s.tokens) for s in samples], self.settings.max_tokens_per_micro_batch)

    def _values(self, mb: PackedMicroBatch) -> Tensor:
        with self.autocast():
            return self.model(mb.input_ids, mb.position_ids).reshape(-1)[mb.logit_index]  # [N]

    @torch.no_grad()
    def values(self, samples: list[Sample]) -> list[list[float]]:
        """The current values of each sample's response tokens."""
        out: list[list[float]] = [[] for _ in samples]
        for b in self._micro_batches(samples):
            mb = self.pack([samples[j] for j in b])
            for j, v in zip(b, mb.split(self._values(mb))):
                out[j] = v.tolist()
        return out

    def train(self, samples: list[Sample], steps: list[range], old_values: list[list[float]],
              returns: list[list[float]], denominators: list[LossDenominators], step: int) -> dict[str, float]:
        """One optimizer step per range of ``steps`` (the policy's), on the value loss aggregated as
        the policy loss is (``--loss-agg``, the step's ``denominators``). Returns the means over the
        optimizer steps of ``value_loss``, ``value_clipfrac``, ``critic_grad_norm``, and the
        ``critic_lr`` of the last."""
        s = self.settings
        sums = {"value_loss": 0.0, "value_clipfrac": 0.0, "critic_grad_norm": 0.0}
        # summed over the micro-batches on the device, read once per optimizer step (a read per
        # micro-batch would stall an accelerator's queue)
        lr = self.optimizer.param_groups[0]["lr"]
        for k, (r, denom) in enumerate(zip(steps, denominators)):
            idx = list(r)
            self.optimizer.zero_grad(set_to_none=True)
            step_loss = step_clipped = torch.zeros((), dtype=torch.float64)
            for b in self._micro_batches([samples[i] for i in idx]):
                chosen = [idx[j] for j in b]
                mb = self.pack([samples[i] for i in chosen])
                device = mb.loss_mask.device
                old = torch.tensor([x for i in chosen for x in old_values[i]], device=device)  # [N]
                ret = torch.tensor([x for i in chosen for x in returns[i]], device=device)  # [N]
                loss_tok, clipped = value_loss(self._values(mb), old, ret, s.value_clip)  # [N]
                loss = aggregate(loss_tok, mb.loss_mask, s.loss_agg, mb.seq_ids, mb.num_seqs, denom)
                loss.backward()
                step_loss = step_loss.to(device) + loss.detach().double()
                step_clipped = step_clipped.to(device) + aggregate(clipped, mb.loss_mask, s.loss_agg, mb.seq_ids,
                                                                   mb.num_seqs, denom).double()
            if not math.isfinite(float(step_loss)):
                self.optimizer.zero_grad(set_to_none=True)
                raise RuntimeError(f"train_step {step}: non-finite critic value loss {float(step_loss)} in optimizer "
                                   f"step {k}; the critic was not updated")
            sums["value_loss"] += float(step_loss)
            sums["value_clipfrac"] += float(step_clipped)
            max_norm = s.clip_grad if s.clip_grad > 0 else float("inf")
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
            if not math.isfinite(norm):
                self.optimizer.zero_grad(set_to_none=True)
                raise RuntimeError(f"train_step {step}: non-finite critic grad norm {norm} in optimizer step {k}; "
                                   "the critic was not updated")
            sums["critic_grad_norm"] += norm
            lr = self.optimizer.param_groups[0]["lr"]
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        out = {k: v / max(len(steps), 1) for k, v in sums.items()}
        out["critic_lr"] = lr
        return out
