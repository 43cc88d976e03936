"""``slime.backends.megatron_utils.loss``: the helper custom loss functions call on the logits
they get (``--custom-loss-function-path``, ``train_backend/hooks.py``), and slime's two TIS
functions by their slime path (``--custom-tis-function-path
slime.backends.megatron_utils.loss.icepop_function``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from slime_compat.utils.ppo_utils import compute_approx_kl, compute_policy_loss  # noqa: F401  (slime re-exports)
from train_backend.losses import truncated_is
from train_backend.mismatch import icepop_is


def get_log_probs_and_entropy(logits: Tensor, *, args: Any, unconcat_tokens: list[Tensor], total_lengths: list[int],
                              response_lengths: list[int], with_entropy: bool = False, **_: Any
                              ) -> tuple[Any, dict[str, list[Tensor]]]:
    """Per-sample response-token log-probs (and entropies) from slime-layout logits ``[1, T, V]``
    (sequences end to end; token t of a sequence predicted at position t - 1), as slime's helper:
    logits divided by ``args.rollout_temperature``. Returns ``(None, {"log_probs": [...],
    "entropy": [...]})``; the lists are differentiable in ``logits``."""
    x = logits[0]  # [T, V]
    out: dict[str, list[Tensor]] = {"log_probs": []}
    if with_entropy:
        out["entropy"] = []
    end = 0
    for tokens, total, resp in zip(unconcat_tokens, total_lengths, response_lengths):
        end += int(total)
        rows = x[end - resp - 1:end - 1].float() / args.rollout_temperature  # [r, V]
        logp_all = torch.log_softmax(rows, dim=-1)  # [r, V]
        target = torch.as_tensor(tokens[-resp:], device=rows.device).long()  # [r]
        out["log_probs"].append(logp_all.gather(-1, target[:, None]).squeeze(-1))
        if with_entropy:
            out["entropy"].append(-(logp_all.exp() * logp_all).sum(-1))
    return None, out


def vanilla_tis_function(args: Any, *, pg_loss: Tensor, train_log_probs: list[Tensor],
                         rollout_log_probs: list[Tensor], loss_masks: list[Tensor], **_: Any
                         ) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """slime's default TIS (``--custom-tis-function-path``'s contract): the policy loss times the
    train/rollout ratio clipped to ``[args.tis_clip_low, args.tis_clip]``; every token kept. Metrics
    per token: ``tis`` (the raw ratio), ``tis_clipfrac``, ``tis_abs`` (``|ratio - 1|``). The built-in
    ``--use-tis`` (:func:`train_backend.losses.truncated_is`) itself."""
    mask = torch.cat(loss_masks)
    pg, _, stats = truncated_is(pg_loss, torch.cat(train_log_probs), torch.cat(rollout_log_probs), mask,
                                torch.zeros_like(mask, dtype=torch.long), 1, args.tis_clip, args.tis_clip_low)
    del stats["tis_weight"]  # slime's function logs the ratio, not the weight
    return pg, loss_masks, stats


def icepop_function(args: Any, *, pg_loss: Tensor, train_log_probs: list[Tensor],
                    rollout_log_probs: list[Tensor], loss_masks: list[Tensor], **_: Any
                    ) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """slime's IcePop: tokens whose train/rollout ratio lies in ``[args.tis_clip_low, args.tis_clip]``
    weighted by it, the others weighted 0 (their loss masks stay: they still count in the
    denominators). Metrics as :func:`vanilla_tis_function`'s, ``tis_clipfrac`` the zeroed fraction.
    The built-in ``--tis-function icepop`` (:func:`train_backend.mismatch.icepop_is`) itself."""
    mask = torch.cat(loss_masks)
    pg, _, stats = icepop_is(pg_loss, torch.cat(train_log_probs), torch.cat(rollout_log_probs), mask,
                             torch.zeros_like(mask, dtype=torch.long), 1, args.tis_clip, args.tis_clip_low)
    return pg, loss_masks, stats
