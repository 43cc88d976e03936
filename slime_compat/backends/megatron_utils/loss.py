"""``slime.backends.megatron_utils.loss``: the helper custom loss functions call on the logits
they get (``--custom-loss-function-path``, ``train_backend/hooks.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from slime_compat.utils.ppo_utils import compute_approx_kl, compute_policy_loss  # noqa: F401  (slime re-exports)


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
