"""slime's trainer-side plugins, called where slime calls them and with what slime passes.

Every hook is loaded once per trainer rank through :func:`plugins.loader.load_function` (the one
extension mechanism; errors name the flag and the path) and gets ``args``: the run's flags under
slime's names (:func:`plugin_args`). The call sites, in both backends unless noted:

- ``--custom-advantage-function-path`` ``fn(args, rollout_data)``: once per rollout batch, after
  the batch is prepared; ``rollout_data`` holds per-sample lists (``rewards``: the estimator's
  per-sample values, for grpo/gspo slime's group-normalised rewards; ``raw_reward``;
  ``log_probs``: the policy's before this rollout's updates; ``ref_log_probs`` with
  ``--use-kl-loss``; ``rollout_log_probs``; ``loss_masks``; ``response_lengths``;
  ``total_lengths``; ``kl``: zeros, as slime's with ``--kl-coef 0``). It must set
  ``rollout_data["advantages"]`` (one per-token tensor per sample); ``--normalize-advantages``
  whitens them afterwards, as in slime.
- ``--custom-loss-function-path`` (``--loss-type custom_loss``) ``fn(args, batch, logits,
  sum_of_sample_mean) -> (loss, metrics)`` per micro-batch, instead of the policy loss. ``logits``
  are slime's ``[1, T, V]`` layout (the micro-batch's sequences end to end; only the positions
  that predict response tokens are filled, the ones slime's helpers read) and
  ``sum_of_sample_mean`` reduces a flat per-token tensor with the step-wide denominators of
  ``--loss-agg``, so the returned loss is already the micro-batch's share of the step's loss.
  ``slime.backends.megatron_utils.loss.get_log_probs_and_entropy`` reads these logits.
- ``--custom-tis-function-path`` (with ``--use-tis``) replaces the TIS weights inside the policy
  loss: ``fn(args=, pg_loss=, train_log_probs=, rollout_log_probs=, loss_masks=,
  total_lengths=, response_lengths=) -> (pg_loss, loss_masks, metrics)``; the returned masks
  zero tokens in the numerators, the denominators stay the original masks' (as in slime).
- ``--custom-pg-loss-reducer-function-path`` ``fn(total_lengths, response_lengths, loss_masks,
  calculate_per_token_loss) -> reducer``: reduces the policy-gradient loss of a micro-batch in
  slime's convention (a sum over its samples, or over its tokens with ``--loss-agg token_mean``),
  which is divided by the step's samples (tokens) as slime's Megatron loss scaling does.
- ``--custom-megatron-init-path`` ``fn(args)``: once, after the parallel state, model and
  optimizer exist (torch backend: after the HF model and optimizer are built).
- ``--custom-megatron-before-log-prob-hook-path`` ``fn(args, model, store_prefix)``: before the
  policy's log-probs of a rollout batch (``""``) and before the reference's (``"ref_"``); ``model``
  is the list of model chunks (torch backend: ``[hf_model]``).
- ``--custom-megatron-before-train-step-hook-path`` ``fn(args, rollout_id, step_id, model,
  optimizer, opt_param_scheduler)`` before each optimizer step; the scheduler is None on the
  Megatron backend (the learning rate is set per step from ``--lr-*``), torch's ``LambdaLR`` on
  the torch backend.
- ``--custom-model-provider-path`` ``fn(pre_process, post_process[, vp_stage]) -> module``
  (Megatron backend only): builds each pipeline stage instead of the built-in GPT model; the HF
  weights of ``--hf-checkpoint`` are then loaded into it, so its parameter names must be
  megatron-core ``GPTModel``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from train_backend.settings import TrainSettings

_SIGNATURES: dict[str, list[str] | None] = {
    "custom_loss_function_path": ["args", "batch", "logits", "sum_of_sample_mean"],
    "custom_advantage_function_path": ["args", "rollout_data"],
    "custom_tis_function_path": None,  # called with keyword arguments only
    "custom_pg_loss_reducer_function_path": ["total_lengths", "response_lengths", "loss_masks",
                                             "calculate_per_token_loss"],
    "custom_model_provider_path": ["pre_process", "post_process"],
    "custom_megatron_init_path": ["args"],
    "custom_megatron_before_log_prob_hook_path": ["args", "model", "store_prefix"],
    "custom_megatron_before_train_step_hook_path": ["args", "rollout_id", "step_id", "model", "optimizer",
                                                    "opt_param_scheduler"],
}


def plugin_args(settings: TrainSettings) -> argparse.Namespace:
    """``args`` as trainer-side plugins see it: the launcher's namespace (``settings.plugin_args``)
    or, without one, the settings' fields; plus slime's names for what they mean here."""
    from slime_compat._args import fill_trainer_args

    values = dict(settings.plugin_args) if settings.plugin_args is not None else dataclasses.asdict(settings)
    return fill_trainer_args(argparse.Namespace(**values), settings)


@dataclass
class TrainHooks:
    """The loaded hooks (None where not set) and the ``args`` they get."""

    args: argparse.Namespace
    loss: Callable | None = None
    advantage: Callable | None = None
    tis: Callable | None = None
    pg_loss_reducer: Callable | None = None
    model_provider: Callable | None = None
    init: Callable | None = None
    before_log_prob: Callable | None = None
    before_train_step: Callable | None = None

    @classmethod
    def load(cls, settings: TrainSettings) -> "TrainHooks":
        from plugins.loader import load_function

        fns = {}
        for dest, params in _SIGNATURES.items():
            path = getattr(settings, dest)
            if path:
                fns[dest] = load_function(path, "--" + dest.replace("_", "-"), params, is_async=False)
        return cls(plugin_args(settings), fns.get("custom_loss_function_path"),
                   fns.get("custom_advantage_function_path"), fns.get("custom_tis_function_path"),
                   fns.get("custom_pg_loss_reducer_function_path"), fns.get("custom_model_provider_path"),
                   fns.get("custom_megatron_init_path"), fns.get("custom_megatron_before_log_prob_hook_path"),
                   fns.get("custom_megatron_before_train_step_hook_path"))

    # --- call sites ---------------------------------------------------------------------------
    def call_init(self) -> None:
        if self.init is not None:
            self.init(self.args)

    def call_before_log_prob(self, model: list[torch.nn.Module], store_prefix: str) -> None:
        if self.before_log_prob is not None:
            self.before_log_prob(self.args, model, store_prefix)

    def call_before_train_step(self, rollout_id: int, step_id: int, model: list[torch.nn.Module], optimizer: Any,
                               scheduler: Any) -> None:
        if self.before_train_step is not None:
            self.before_train_step(self.args, rollout_id, step_id, model, optimizer, scheduler)

    def build_model(self, pre_process: bool, post_process: bool) -> torch.nn.Module:
        import inspect

        assert self.model_provider is not None
        kw: dict[str, Any] = {"pre_process": pre_process, "post_process": post_process}
        if "vp_stage" in inspect.signature(self.model_provider).parameters:
            kw["vp_stage"] = None  # no virtual pipeline stages here
        model = self.model_provider(**kw)
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"--custom-model-provider-path returned {type(model).__name__}, not a torch.nn.Module")
        return model

    def advantages(self, samples: list, values: list[float], raw_rewards: list[float], log_probs: list[list[float]],
                   ref_log_probs: list[list[float]] | None) -> list[list[float]]:
        """Call the advantage hook on the batch; returns per-token advantages, one list per sample."""
        assert self.advantage is not None
        f32 = torch.float32
        data: dict[str, Any] = {
            "rewards": list(values), "raw_reward": list(raw_rewards),
            "log_probs": [torch.tensor(x, dtype=f32) for x in log_probs],
            "rollout_log_probs": [torch.tensor(s.rollout_log_probs or [0.0] * s.response_length, dtype=f32)
                                  for s in samples],
            "loss_masks": [torch.tensor(s.loss_mask, dtype=torch.int32) for s in samples],
            "response_lengths": [s.response_length for s in samples],
            "total_lengths": [len(s.tokens) for s in samples],
            "kl": [torch.zeros(s.response_length, dtype=f32) for s in samples],
        }
        if ref_log_probs is not None:
            data["ref_log_probs"] = [torch.tensor(x, dtype=f32) for x in ref_log_probs]
        self.advantage(self.args, data)
        adv = data.get("advantages")
        flag = "--custom-advantage-function-path"
        if not isinstance(adv, (list, tuple)) or len(adv) != len(samples):
            raise ValueError(f"{flag}: must set rollout_data['advantages'] to a list of {len(samples)} per-token "
                             f"tensors (got {type(adv).__name__})")
        out = []
        for i, (a, s) in enumerate(zip(adv, samples)):
            t = torch.as_tensor(a, dtype=torch.float64).reshape(-1)
            if t.numel() != s.response_length:
                raise ValueError(f"{flag}: advantages of sample {i} have {t.numel()} entries, its response "
                                 f"{s.response_length} tokens")
            out.append(t.tolist())
        return out

    def custom_loss(self, resp_logits: Tensor, packed: Any, reducer: Callable[[Tensor], Tensor],
                    old_logp: Tensor | None, ref_logp: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
        """One micro-batch through the custom loss. ``resp_logits [N, V]`` (full vocabulary) are
        the logits predicting each response token, in ``packed``'s (a ``PackedMicroBatch``) order."""
        assert self.loss is not None
        total = packed.total_lengths
        resp = packed.response_lengths
        # slime's layout: sequences end to end in one row; token t of a sequence is predicted at t - 1
        ends = torch.tensor(total).cumsum(0)  # [S]
        pos = torch.cat([torch.arange(int(e) - r - 1, int(e) - 1) for e, r in zip(ends, resp)]).to(resp_logits.device)
        full = resp_logits.new_zeros(int(ends[-1]), resp_logits.shape[-1]).index_copy(0, pos, resp_logits)
        split = packed.split
        batch: dict[str, Any] = {
            "unconcat_tokens": [torch.tensor(t, device=resp_logits.device) for t in packed.sequences],
            "response_lengths": list(resp), "total_lengths": list(total),
            "loss_masks": split(packed.loss_mask), "advantages": split(packed.advantages),
            "rollout_mask_sums": [m.sum() for m in split(packed.loss_mask)],
        }
        if old_logp is not None:
            batch["log_probs"] = split(old_logp)
        if ref_logp is not None:
            batch["ref_log_probs"] = split(ref_logp)
        if bool(packed.rollout_mask.all()):
            batch["rollout_log_probs"] = split(packed.rollout_logp)
        result = self.loss(self.args, batch, full.unsqueeze(0), reducer)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Tensor)):
            raise ValueError("--custom-loss-function-path: must return (loss tensor, metrics dict), got "
                             f"{type(result).__name__}")
        loss, metrics = result
        return loss, {k: torch.as_tensor(v).detach().float().sum() for k, v in dict(metrics).items()}
