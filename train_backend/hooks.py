"""slime's trainer-side plugins, called where slime calls them and with what slime passes.

Every hook is loaded once per trainer rank through :func:`plugins.loader.load_function` (the one
extension mechanism; errors name the flag and the path) and gets ``args``: the run's flags under
slime's names (:func:`plugin_args`). The call sites, in both backends unless noted:

- ``--custom-advantage-function-path`` ``fn(args, rollout_data)``: once per rollout batch, after
  the batch is prepared; ``rollout_data`` holds per-sample lists (``rewards``: the estimator's
  per-sample values, for grpo/gspo slime's group-normalised rewards; ``raw_reward``;
  ``log_probs``: the policy's before this rollout's updates; ``ref_log_probs`` with
  ``--use-kl-loss``; ``rollout_log_probs``; ``loss_masks``; ``response_lengths``;
  ``total_lengths``; ``kl``: zeros, as slime's with ``--kl-coef 0``; for ``--agent-env`` episodes,
  ``turns``: each sample's turn log, spans relative to the response (``buffer.agent_turns``):
  ``{"kind", "start", "end", "weight_versions", "reward"}`` per turn, so a hook can give each model
  turn its own credit). It must set
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
- ``--custom-reward-post-process-path`` ``fn(args, samples) -> (raw_rewards, rewards)``: once per
  rollout batch on each rank, with the batch's trainable samples (slime's ``Sample``, flat, in group
  order), instead of the estimator's per-group normalisation: each sample's ``rewards`` entry is
  its advantage on every token (what slime's grpo / gspo / reinforce++ estimators make of it),
  whitened afterwards with ``--normalize-advantages``.
- ``--custom-convert-samples-to-train-data-path`` ``fn(args, samples) -> train_data``: the same
  place, instead of slime's sample conversion (so the reward post-process is not called);
  ``train_data`` holds one entry per sample in the same order: ``tokens``, ``response_lengths``,
  ``loss_masks``, ``rewards`` (as above) and optionally ``rollout_log_probs``; these replace the
  samples' own fields for training.
- ``--rollout-data-postprocess-path`` ``fn(args, rollout_id, rollout_data)``: once per rollout
  batch on each rank, after the log-probs and advantages (the same ``rollout_data`` as the
  advantage hook's, plus per-token ``advantages`` / ``returns``, ``tokens``, ``sample_indices``,
  ``truncated``), before training. Changes it makes to ``advantages`` and ``loss_masks`` are
  trained on (slime's data iterator reads the same dict); other keys are not read back. slime
  hands each data-parallel rank its own share; here every rank gets the whole batch.
- ``--custom-model-provider-path`` ``fn(pre_process, post_process[, vp_stage]) -> module``
  (Megatron backend only): builds each pipeline stage instead of the built-in GPT model; the HF
  weights of ``--hf-checkpoint`` are then loaded into it, so its parameter names must be
  megatron-core ``GPTModel``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from buffer.agent_turns import AGENT_TURNS, turns_for_training
from buffer.sample import Status
from train_backend.losses import ImportanceFn, LossDenominators, ReducerFn, whiten_advantages
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
    "custom_reward_post_process_path": ["args", "samples"],
    "custom_convert_samples_to_train_data_path": ["args", "samples"],
    "rollout_data_postprocess_path": ["args", "rollout_id", "rollout_data"],
}
_FIELDS = {"custom_loss_function_path": "loss", "custom_advantage_function_path": "advantage",
           "custom_tis_function_path": "tis", "custom_pg_loss_reducer_function_path": "pg_loss_reducer",
           "custom_model_provider_path": "model_provider", "custom_megatron_init_path": "init",
           "custom_megatron_before_log_prob_hook_path": "before_log_prob",
           "custom_megatron_before_train_step_hook_path": "before_train_step",
           "custom_reward_post_process_path": "reward_post_process",
           "custom_convert_samples_to_train_data_path": "convert_samples",
           "rollout_data_postprocess_path": "data_postprocess"}
# a plugin's per-sample log-probs of the policy ("") or the reference ("ref_"; None without one)
LogProbsFn = Callable[[str, list], "list[list[float]] | None"]


def plugin_args(settings: TrainSettings) -> argparse.Namespace:
    """``args`` as trainer-side plugins see it: the launcher's namespace (``settings.plugin_args``)
    or, without one, the settings' fields; plus slime's names for what they mean here."""
    from plugins.slime_args import fill_trainer_args

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
    reward_post_process: Callable | None = None
    convert_samples: Callable | None = None
    data_postprocess: Callable | None = None
    reward_key: str | None = None  # --reward-key: the raw reward of a dict reward

    @classmethod
    def load(cls, settings: TrainSettings) -> "TrainHooks":
        """Load the hooks whose flags ``settings`` sets (each checked against slime's signature) and their ``args``.

        Raises ValueError naming the flag and the path when one cannot be loaded.
        """
        from plugins.loader import load_function

        fns = {}
        for dest, params in _SIGNATURES.items():
            path = getattr(settings, dest)
            if path:
                flag = "--" + dest.replace("_", "-")
                fns[_FIELDS[dest]] = _naming(load_function(path, flag, params, is_async=False), flag, path)
        return cls(plugin_args(settings), reward_key=settings.reward_key, **fns)

    # --- call sites ---------------------------------------------------------------------------
    def call_init(self) -> None:
        """Call ``--custom-megatron-init-path`` with ``args``, if set."""
        if self.init is not None:
            self.init(self.args)

    def call_before_log_prob(self, model: list[torch.nn.Module], store_prefix: str) -> None:
        """Call ``--custom-megatron-before-log-prob-hook-path``, if set, with the model chunks and ``store_prefix``."""
        if self.before_log_prob is not None:
            self.before_log_prob(self.args, model, store_prefix)

    def call_before_train_step(self, rollout_id: int, step_id: int, model: list[torch.nn.Module], optimizer: Any,
                               scheduler: Any) -> None:
        """Call ``--custom-megatron-before-train-step-hook-path``, if set, before optimizer step ``step_id``."""
        if self.before_train_step is not None:
            self.before_train_step(self.args, rollout_id, step_id, model, optimizer, scheduler)

    def build_model(self, pre_process: bool, post_process: bool) -> torch.nn.Module:
        """One pipeline stage from ``--custom-model-provider-path`` (``vp_stage=None`` when it takes one).

        Raises ValueError when the provider does not return a ``torch.nn.Module``.
        """
        import inspect

        assert self.model_provider is not None
        kw: dict[str, Any] = {"pre_process": pre_process, "post_process": post_process}
        if "vp_stage" in inspect.signature(self.model_provider).parameters:
            kw["vp_stage"] = None  # no virtual pipeline stages here
        model = self.model_provider(**kw)
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"--custom-model-provider-path returned {type(model).__name__}, not a torch.nn.Module")
        return model

    # --- the rollout batch before training ---------------------------------------------------
    def train_values(self, samples: list) -> tuple[list, list[float]] | None:
        """slime's sample-to-train-data step on the trainable ``samples`` (flat, group order):
        ``(samples to train, per-sample advantage values)``, or None when neither
        ``--custom-convert-samples-to-train-data-path`` nor ``--custom-reward-post-process-path``
        is set (the estimator's values stand)."""
        if self.convert_samples is not None:
            return _converted(self.convert_samples(self.args, samples), samples)
        if self.reward_post_process is None:
            return None
        flag = "--custom-reward-post-process-path"
        out = self.reward_post_process(self.args, samples)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise ValueError(f"{flag}: must return (raw_rewards, rewards), got {type(out).__name__}")
        return samples, _floats(out[1], len(samples), flag, "rewards")

    @property
    def needs_rollout_data(self) -> bool:
        """Whether a hook reads the batch's log-probs before training (they cost a forward pass)."""
        return self.advantage is not None or self.data_postprocess is not None

    def rollout_data_step(self, samples: list, values: list[float], adv: list, rollout_id: int,
                          log_probs: LogProbsFn, normalize: bool) -> list:
        """slime's steps between the log-probs and the training of a rollout batch:
        ``--custom-advantage-function-path`` (then ``--normalize-advantages``), then
        ``--rollout-data-postprocess-path``. ``values`` are the estimator's per-sample values
        (slime's ``rewards``), ``adv`` the advantages so far (``values`` whitened with
        ``--normalize-advantages``). Returns the advantages, per token; a sample whose loss mask
        the post-process changed is replaced in ``samples`` by a copy with it. Collective: ``log_probs``
        runs forward passes on every rank."""
        data = self._rollout_data(samples, values, log_probs)
        if self.advantage is not None:
            adv = self._call_advantage(data, samples)
            if normalize:
                adv = whiten_advantages(samples, adv)
        if self.data_postprocess is None:
            return adv
        flag = "--rollout-data-postprocess-path"
        per_token = [a if isinstance(a, list) else [a] * s.response_length for a, s in zip(adv, samples)]
        data["advantages"] = [torch.tensor(a, dtype=torch.float32) for a in per_token]
        data["returns"] = [a.clone() for a in data["advantages"]]
        data["tokens"] = [torch.tensor(s.tokens) for s in samples]
        data["sample_indices"] = [s.index for s in samples]
        data["truncated"] = [int(s.status == Status.TRUNCATED) for s in samples]
        self.data_postprocess(self.args, rollout_id, data)
        adv = _per_token(data.get("advantages"), samples, flag, "advantages", torch.float64)
        masks = _per_token(data.get("loss_masks"), samples, flag, "loss_masks", torch.int64)
        for i, m in enumerate(masks):
            if any(x not in (0, 1) for x in m):
                raise ValueError(f"{flag}: loss_masks of sample {samples[i].index} hold values other than 0 and 1")
            samples[i] = samples[i].copy(loss_mask=[int(x) for x in m])  # the caller's Sample stays as it was
        return adv

    def _rollout_data(self, samples: list, values: list, log_probs: LogProbsFn) -> dict[str, Any]:
        """slime's ``rollout_data`` at the point its advantage hook runs (per-sample lists)."""
        f32 = torch.float32
        logp = log_probs("", samples)
        ref = log_probs("ref_", samples)
        data: dict[str, Any] = {
            "rewards": list(values),
            "raw_reward": [s.scalar_reward(self.reward_key) for s in samples],
            "log_probs": [torch.tensor(x, dtype=f32) for x in logp],
            "rollout_log_probs": [torch.tensor(s.rollout_log_probs or [0.0] * s.response_length, dtype=f32)
                                  for s in samples],
            "loss_masks": [torch.tensor(s.loss_mask, dtype=torch.int32) for s in samples],
            "response_lengths": [s.response_length for s in samples],
            "total_lengths": [len(s.tokens) for s in samples],
            "kl": [torch.zeros(s.response_length, dtype=f32) for s in samples],
        }
        if ref is not None:
            data["ref_log_probs"] = [torch.tensor(x, dtype=f32) for x in ref]
        if any(s.metadata.get(AGENT_TURNS) for s in samples):  # turn-level credit for --agent-env episodes
            data["turns"] = [turns_for_training(s) for s in samples]
        return data

    def _call_advantage(self, data: dict[str, Any], samples: list) -> list[list[float]]:
        """The advantage hook on ``data``; returns per-token advantages, one list per sample."""
        assert self.advantage is not None
        self.advantage(self.args, data)
        return _per_token(data.get("advantages"), samples, "--custom-advantage-function-path", "advantages",
                          torch.float64)

    # --- inside the loss of a micro-batch ----------------------------------------------------
    def importance(self, total_lengths: list[int]) -> ImportanceFn | None:
        """``--custom-tis-function-path`` as :func:`~train_backend.losses.rl_loss` takes it, for a
        micro-batch whose sequences have ``total_lengths`` (prompt + response); None without one."""
        if self.tis is None:
            return None
        tis, args = self.tis, self.args

        def weigh(pg: Tensor, old_logp: Tensor, rollout_logp: Tensor, m: Tensor, seq_ids: Tensor, num_seqs: int
                  ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            # slime's tis_func(**kwargs) -> (pg_loss, loss_masks, metrics), on per-sample lists
            lengths = torch.bincount(seq_ids, minlength=num_seqs).tolist()
            out = tis(args=args, pg_loss=pg, train_log_probs=list(torch.split(old_logp.detach(), lengths)),
                      rollout_log_probs=list(torch.split(rollout_logp, lengths)),
                      loss_masks=list(torch.split(m, lengths)), total_lengths=total_lengths, response_lengths=lengths)
            if not (isinstance(out, tuple) and len(out) == 3):
                raise ValueError("--custom-tis-function-path: must return (pg_loss, loss_masks, metrics)")
            new_pg, masks, metrics = out
            if not isinstance(new_pg, Tensor) or new_pg.shape != pg.shape:
                raise ValueError(f"--custom-tis-function-path: pg_loss must be a tensor of shape {tuple(pg.shape)}")
            mask = torch.cat([torch.as_tensor(x, dtype=m.dtype, device=m.device) for x in masks]) if masks else m
            if mask.shape != m.shape:
                raise ValueError(f"--custom-tis-function-path: loss_masks hold {mask.numel()} tokens, expected "
                                 f"{m.numel()}")
            return new_pg, mask * m, {k: torch.as_tensor(v, device=m.device).detach().to(m.dtype)
                                      for k, v in dict(metrics).items()}
        return weigh

    def reducer(self, loss_agg: str, denom: LossDenominators, total_lengths: list[int]) -> ReducerFn | None:
        """``--custom-pg-loss-reducer-function-path`` as :func:`~train_backend.losses.rl_loss` takes
        it (None without one). slime's reducer works in its micro-batch convention (a sum over
        samples, or over tokens with per-token loss) that its Megatron scaling divides by the step's
        samples (tokens); the same division here makes the micro-batch losses sum to the step's."""
        if self.pg_loss_reducer is None:
            return None
        make = self.pg_loss_reducer
        per_token = loss_agg == "token_mean"

        def reduce(pg: Tensor, pg_mask: Tensor, seq_ids: Tensor, num_seqs: int) -> Tensor:
            lengths = torch.bincount(seq_ids, minlength=num_seqs).tolist()
            fn = make(total_lengths, lengths, list(torch.split(pg_mask, lengths)), per_token)
            return fn(pg) / max(denom.num_tokens if per_token else denom.num_seqs, 1.0)
        return reduce

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


def _naming(fn: Callable, flag: str, path: str) -> Callable:
    """``fn`` whose exceptions name the plugin: ``RuntimeError('<flag> <path> raised ...')``, so a
    run that a trainer-side plugin ended says which one (the original is its ``__cause__``)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise RuntimeError(f"{flag} {path} raised {type(e).__name__}: {e}") from e
    return call


def _per_token(value: Any, samples: list, flag: str, key: str, dtype: torch.dtype) -> list[list]:
    """``rollout_data[key]`` checked as one per-token sequence per sample, as lists."""
    if not isinstance(value, (list, tuple)) or len(value) != len(samples):
        raise ValueError(f"{flag}: rollout_data[{key!r}] must be a list of {len(samples)} per-token tensors "
                         f"(got {type(value).__name__})")
    out = []
    for i, (a, s) in enumerate(zip(value, samples)):
        t = torch.as_tensor(a, dtype=dtype).reshape(-1)
        if t.numel() != s.response_length:
            raise ValueError(f"{flag}: rollout_data[{key!r}] of sample {i} has {t.numel()} entries, its "
                             f"response {s.response_length} tokens")
        out.append(t.tolist())
    return out


def _floats(value: Any, n: int, flag: str, key: str) -> list[float]:
    try:
        out = [float(x) for x in value]
    except (TypeError, ValueError):
        raise ValueError(f"{flag}: {key} must be {n} numbers, got {type(value).__name__}") from None
    if len(out) != n:
        raise ValueError(f"{flag}: returned {len(out)} {key} for {n} samples")
    return out


def _converted(data: Any, samples: list) -> tuple[list, list[float]]:
    """``--custom-convert-samples-to-train-data-path``'s ``train_data`` as samples to train and
    their advantage values; each sample's training fields replaced by the dict's entries."""
    flag = "--custom-convert-samples-to-train-data-path"
    n = len(samples)
    if not isinstance(data, dict):
        raise ValueError(f"{flag}: must return slime's train_data dict, got {type(data).__name__}")
    for key in ("tokens", "response_lengths", "loss_masks", "rewards"):
        if key not in data:
            raise ValueError(f"{flag}: train_data lacks {key!r} (needs tokens, response_lengths, loss_masks, "
                             "rewards)")
        if len(data[key]) != n:
            raise ValueError(f"{flag}: train_data[{key!r}] has {len(data[key])} entries for {n} samples (one per "
                             "sample, in order)")
    values = _floats(data["rewards"], n, flag, "rewards")
    rollout_lp = data.get("rollout_log_probs")
    out = []
    for i, s in enumerate(samples):
        fields: dict[str, Any] = {
            "tokens": [int(t) for t in torch.as_tensor(data["tokens"][i]).reshape(-1).tolist()],
            "response_length": int(data["response_lengths"][i]),
            "loss_mask": [int(m) for m in torch.as_tensor(data["loss_masks"][i]).reshape(-1).tolist()],
        }
        if rollout_lp is not None:
            fields["rollout_log_probs"] = [float(x) for x in torch.as_tensor(rollout_lp[i]).reshape(-1).tolist()]
        out.append(s.copy(**fields))
    return out, values
