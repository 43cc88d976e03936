"""One train step, for every backend: :func:`run_train_step` on a :class:`StepBackend`.

The skeleton is written once here: receive rank 0's groups, prepare the batch
(:func:`~train_backend.batching.begin_train_step`), give this rank its share of each optimizer
step, the old and reference log-probs (each after slime's before-log-prob hook), then per
optimizer step the micro-batches' losses (:func:`~train_backend.losses.rl_loss`, or a custom loss)
with backward, a non-finite check that every rank takes alike, the optimizer step, and the
metrics (:class:`StepStats`). A backend supplies only what is its own: how it cuts its share into
micro-batches, runs a forward-only or a forward-and-backward pass over them, and steps its
optimizer (the torch backend: HF model + FSDP2; the Megatron backend: its pipeline schedule).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from buffer.sample import Sample
from metric_keys import (TRAIN_BATCHING_TIME, TRAIN_FORWARD_BACKWARD_TIME, TRAIN_LOG_PROB_TIME, TRAIN_OPTIMIZER_TIME,
                         TRAIN_REWARD_MEAN, TRAIN_STATS_TIME, TRAIN_TOKENS_PER_S)
from train_backend.batching import PackedMicroBatch, RolloutBatch, balance, begin_train_step
from train_backend.hooks import TrainHooks
from train_backend.losses import (ROLLOUT_SUM_STATS, ROLLOUT_COUNT, STEP_MEAN_STATS, LossConfig, LossDenominators,
                                  aggregate, count_samples_without_loss_tokens, rl_loss, sft_loss)
from train_backend.mismatch import builtin_importance
from train_backend.settings import TrainSettings

# What a forward pass gives the loss of one micro-batch: its response tokens' log-probs and
# entropies ``[N]`` (the entropy with its graph when asked: it costs another ``[N, V]`` pass), and
# the raw full-vocabulary logits predicting each response token ``[N, V]`` (a custom loss's input).
LogProbsOf = Callable[[bool], "tuple[Tensor, Tensor | None]"]
LogitsOf = Callable[[], Tensor]
# The loss of micro-batch ``j`` of an optimizer step, from its forward pass; the backend
# back-propagates what it returns as is.
MicroBatchLoss = Callable[[int, LogProbsOf, LogitsOf], Tensor]

_BUILTIN_STATS = STEP_MEAN_STATS + ROLLOUT_SUM_STATS + (ROLLOUT_COUNT,)


class StepBackend(Protocol):
    """What :func:`run_train_step` needs of a backend. ``mb`` below is the backend's own
    micro-batch type; every method is collective (all ranks call it in the same order)."""

    settings: TrainSettings
    hooks: TrainHooks
    loss_cfg: LossConfig
    model: torch.nn.Module
    ref_model: torch.nn.Module | None
    optimizer: Any
    scheduler: Any  # what slime's before-train-step hook gets as ``opt_param_scheduler`` (or None)
    max_seq_len: int | None
    device: torch.device
    dp_rank: int  # this rank's data-parallel replica, of dp_size: the samples are shared over these
    dp_size: int
    # PPO's value model (--advantage-estimator ppo: train_backend.critic.TorchCritic), else None
    critic: Any

    @property
    def reports_stats(self) -> bool:
        """Whether the loss stats and token counts of this rank's micro-batches count (one rank
        per data-parallel replica that sees the loss)."""

    def micro_batches(self, samples: list[Sample], advantages: list, filler: Sample) -> list[Any]:
        """This rank's share of one optimizer step as micro-batches. A rank with nothing to train
        (or fewer micro-batches than another, where the backend needs equal counts) runs
        micro-batches of ``filler`` with an all-zero loss mask and ``num_tokens`` 0."""

    def packed(self, mb: Any) -> PackedMicroBatch:
        """The flat ``[N]`` loss inputs of ``mb`` (:func:`train_backend.batching.pack`)."""

    def forward_log_probs(self, model: torch.nn.Module, mbs: list[Any]) -> list[Tensor | None]:
        """No-grad log-probs ``[N]`` of each micro-batch under ``model`` (the policy or the
        reference); None on ranks that do not see the loss (Megatron's earlier pipeline stages)."""

    def forward_backward(self, mbs: list[Any], loss: MicroBatchLoss) -> None:
        """Forward and backward over ``mbs``, accumulating gradients, with ``loss`` of each."""

    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""

    def optimizer_step(self) -> tuple[float, float]:
        """Clip and apply the accumulated gradients: ``(grad norm, learning rate used)``. A
        non-finite grad norm is returned without updating the weights."""

    def plugin_log_probs(self, prefix: str, samples: list[Sample]) -> list[list[float]] | None:
        """The log-probs slime's rollout-data hooks read (:data:`train_backend.hooks.LogProbsFn`)."""


@dataclass
class StepStats:
    """The metrics of one train step, typed; :meth:`metrics` names them (``train/...``) once."""

    rollout_id: int
    reward_mean: float  # over the rollout batch's trainable-status samples
    num_samples: int  # trained samples
    skipped: dict[str, int]  # samples set aside, per reason (batching.SKIP_REASONS)
    skipped_step: bool = False  # nothing trainable: no optimizer step ran
    # rl_loss's (or a custom loss's or TIS function's) stats by name: means over the optimizer
    # steps; the train/rollout log-prob mismatch means over the rollout tokens
    losses: dict[str, float] = field(default_factory=dict)
    grad_norm: float = 0.0  # mean over the optimizer steps
    lr: float = 0.0  # of the last optimizer step
    optimizer_steps: int = 0
    tokens_per_s: float = 0.0  # prompt + response tokens trained (summed over replicas) / step_time_s
    step_time_s: float = 0.0
    # where step_time_s went, by phase (host time between the phases' ends: on an accelerator a
    # phase's queued kernels may finish inside the next one that waits on them)
    phase_s: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of_batch(cls, batch: RolloutBatch, rollout_id: int) -> "StepStats":
        return cls(rollout_id, batch.reward_mean, len(batch.samples), dict(batch.skipped))

    def metrics(self) -> dict[str, float]:
        """As the backends' ``train_step`` returns them (and ``metrics.jsonl`` logs them)."""
        out = {"train/rollout_id": float(self.rollout_id), TRAIN_REWARD_MEAN.key: self.reward_mean,
               "train/num_samples": float(self.num_samples)}
        out.update({f"train/skipped_{k}": float(v) for k, v in self.skipped.items()})
        if self.skipped_step:
            out["train/skipped_step"] = 1.0
            return out
        out.update({f"train/{n}": v for n, v in self.losses.items()})
        out.update({"train/grad_norm": self.grad_norm, "train/lr": self.lr,
                    "train/optimizer_steps": float(self.optimizer_steps), TRAIN_TOKENS_PER_S.key: self.tokens_per_s,
                    "train/step_time_s": self.step_time_s})
        out.update(self.phase_s)
        return out


def run_train_step(backend: StepBackend, groups: list[list[Sample]] | MissingBatch | None,
                   step: int) -> dict[str, float]:
    """Train ``backend`` on one rollout batch (rank 0's ``groups``; other ranks may pass None;
    rank 0 passes a :class:`MissingBatch` when it has none, and every rank fails with its reason);
    returns the ``train/...`` metrics (identical on every rank)."""
    t0 = time.perf_counter()
    s, hooks = backend.settings, backend.hooks
    critic = backend.critic
    start = begin_train_step(receive_groups(groups), s, step, backend.max_seq_len, hooks, backend.plugin_log_probs,
                             values=None if critic is None else critic.values)
    batch = start.batch
    stats = StepStats.of_batch(batch, step)
    if not batch.samples:
        stats.skipped_step = True
        return stats.metrics()
    phases = _Phases(t0)
    # the samples set aside for having no loss token still count in the seq-mean losses (slime, TRL)
    denominators = count_samples_without_loss_tokens(
        start.denominators, batch.skipped["empty_response"] + batch.skipped["zero_loss_mask"])
    critic_stats: dict[str, float] = {}
    if critic is not None:  # fitted to this rollout's returns, from the values GAE used (slime trains both alike)
        assert start.values is not None and start.returns is not None
        critic_stats = critic.train(batch.samples, start.steps, start.values, start.returns, denominators, step)
        if step < s.num_critic_only_steps:  # slime's --num-critic-only-steps: the policy waits
            stats.losses = critic_stats
            stats.step_time_s = time.perf_counter() - t0
            return stats.metrics()
    plans = [_share(backend, batch, list(r), start.advantages) for r in start.steps]
    phases.end(TRAIN_BATCHING_TIME.key)  # the critic's fit, with --advantage-estimator ppo, counts here
    # old_logp: the policy before this rollout's updates. With a single optimizer step the policy
    # does not change before each micro-batch's forward, so that forward's detached log-probs are
    # exactly the old ones and the extra pass is skipped.
    hooks.call_before_log_prob([backend.model], "")
    # (sft_loss reads no old log-probs: no extra pass either.)
    needs_old = len(plans) > 1 and s.loss_type != "sft_loss"
    old = [backend.forward_log_probs(backend.model, mbs) for mbs in plans] if needs_old else None
    ref = None
    if backend.ref_model is not None:
        hooks.call_before_log_prob([backend.ref_model], "ref_")
        ref = [backend.forward_log_probs(backend.ref_model, mbs) for mbs in plans]
    phases.end(TRAIN_LOG_PROB_TIME.key)

    sums = _StatSums(backend.device)
    grad_norms, lrs = [], []
    for k, (mbs, denom) in enumerate(zip(plans, denominators)):
        backend.zero_grad()
        hooks.call_before_train_step(step, k, [backend.model], backend.optimizer, backend.scheduler)
        phases.end(TRAIN_OPTIMIZER_TIME.key)  # zero_grad and slime's hook count with the optimizer
        losses: list[Tensor] = []  # this rank's micro-batch losses of this optimizer step

        def loss(j: int, log_probs: LogProbsOf, logits: LogitsOf, k: int = k, denom: LossDenominators = denom,
                 mbs: list[Any] = mbs, losses: list[Tensor] = losses) -> Tensor:
            p = backend.packed(mbs[j])
            old_logp = None if old is None else old[k][j]
            ref_logp = None if ref is None else ref[k][j]
            value, mb_stats = _micro_batch_loss(backend, p, denom, log_probs, logits, old_logp, ref_logp)
            # checked once per optimizer step, below: a check here would stall an accelerator's queue
            losses.append(value.detach())
            if backend.reports_stats:
                sums.add(mb_stats)
            return value

        backend.forward_backward(mbs, loss)
        if backend.reports_stats:
            sums.tokens += sum(backend.packed(mb).num_tokens for mb in mbs)  # fillers count 0
        _check_finite_loss(backend, losses, step, k)
        phases.end(TRAIN_FORWARD_BACKWARD_TIME.key)
        grad_norm, lr = backend.optimizer_step()
        phases.end(TRAIN_OPTIMIZER_TIME.key)
        if not torch.isfinite(torch.tensor(grad_norm)):
            backend.zero_grad()  # no half-accumulated step leaks into the next
            raise RuntimeError(f"train_step {step}: non-finite grad norm {grad_norm} in optimizer step {k}; "
                               "the weights were not updated")
        grad_norms.append(grad_norm)
        lrs.append(lr)
    # a plugin's or a built-in correction's stats of its own names (mis_*) are gathered too
    named = hooks.loss is not None or hooks.tis is not None or s.tis_function != "vanilla"
    stats.losses, tokens = sums.reduce(len(plans), with_plugins=named)
    stats.losses.update(critic_stats)
    if start.opd_reverse_kl is not None:
        stats.losses["opd_reverse_kl"] = start.opd_reverse_kl
    phases.end(TRAIN_STATS_TIME.key)
    stats.grad_norm = sum(grad_norms) / len(grad_norms)
    stats.lr = lrs[-1]
    stats.optimizer_steps = len(plans)
    stats.step_time_s = time.perf_counter() - t0
    stats.tokens_per_s = tokens / stats.step_time_s
    stats.phase_s = phases.seconds
    return stats.metrics()


class _Phases:
    """Adds the time since the last ``end`` to a phase's total: the train step's time split."""

    def __init__(self, t0: float) -> None:
        self.last = t0
        self.seconds: dict[str, float] = {}

    def end(self, key: str) -> None:
        now = time.perf_counter()
        self.seconds[key] = self.seconds.get(key, 0.0) + now - self.last
        self.last = now


@dataclass
class MissingBatch:
    """What rank 0 passes instead of the groups when it could not fetch them (a failed buffer
    ``get``): every rank then fails with ``reason`` instead of the other ranks waiting in the
    groups' broadcast for a batch that never comes."""

    reason: str


def receive_groups(groups: list[list[Sample]] | MissingBatch | None) -> list[list[Sample]]:
    """Rank 0's groups, on every rank of the default process group; a :class:`MissingBatch` of
    rank 0 fails every rank with its reason."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        box = [groups]
    else:
        box = [groups if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], MissingBatch):
        raise RuntimeError(f"train_step: no batch (rank 0 could not fetch it): {box[0].reason}")
    if box[0] is None:
        raise ValueError("train_step: groups is None" if world == 1 else "train_step: rank 0 passed groups=None")
    return box[0]


def _share(backend: StepBackend, batch: RolloutBatch, idx: list[int], adv: list) -> list[Any]:
    """This replica's micro-batches of the optimizer step over samples ``idx`` (shared by tokens)."""
    lengths = [len(batch.samples[i].tokens) for i in idx]
    share = [idx[j] for j in balance(lengths, backend.dp_size)[backend.dp_rank]]
    return backend.micro_batches([batch.samples[i] for i in share], [adv[i] for i in share],
                                 filler=batch.samples[idx[0]])


def _micro_batch_loss(backend: StepBackend, p: PackedMicroBatch, denom: LossDenominators, log_probs: LogProbsOf,
                      logits: LogitsOf, old_logp: Tensor | None, ref_logp: Tensor | None
                      ) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's share of the step's loss and its stats: the custom loss with
    ``--loss-type custom_loss``, :func:`~train_backend.losses.sft_loss` with ``sft_loss``, else
    :func:`~train_backend.losses.rl_loss`."""
    s, hooks = backend.settings, backend.hooks
    if hooks.loss is not None:
        def sum_of_sample_mean(x: Tensor) -> Tensor:
            return aggregate(x, p.loss_mask, s.loss_agg, p.seq_ids, p.num_seqs, denom)

        return hooks.custom_loss(logits(), p, sum_of_sample_mean, old_logp, ref_logp)
    if s.loss_type == "sft_loss":
        return sft_loss(log_probs(False)[0], p.loss_mask, p.seq_ids, p.num_seqs, denom, s.loss_agg)
    logp, entropy = log_probs(s.entropy_coef != 0)
    return rl_loss(backend.loss_cfg, denom, logp, logp.detach() if old_logp is None else old_logp, p.advantages,
                   p.loss_mask, p.seq_ids, p.num_seqs, entropy=entropy, ref_logp=ref_logp,
                   rollout_logp=p.rollout_logp, rollout_mask=p.rollout_mask,
                   importance=hooks.importance(p.total_lengths) or builtin_importance(s),
                   reducer=hooks.reducer(s.loss_agg, denom, p.total_lengths))


def _check_finite_loss(backend: StepBackend, losses: list[Tensor], step: int, k: int) -> None:
    """Raise before the optimizer step when a micro-batch loss is not finite: once per optimizer
    step, on the sum over all ranks so that every rank takes the same branch."""
    total = torch.stack(losses).sum() if losses else torch.zeros((), device=backend.device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    if not torch.isfinite(total):
        backend.zero_grad()  # no half-accumulated step leaks into the next
        raise RuntimeError(f"train_step {step}: non-finite loss {total.item()} in optimizer step {k}; "
                           "the weights were not updated")


class _StatSums:
    """This rank's sums of the micro-batch stats over a train step, in float64 on the device (no
    transfer per micro-batch), and of the tokens trained."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, Tensor] = {}
        self.tokens = 0

    def add(self, stats: dict[str, Tensor]) -> None:
        for name, v in stats.items():
            v = torch.as_tensor(v.detach() if isinstance(v, Tensor) else v, dtype=torch.float64, device=self.device)
            self.sums[name] = v if name not in self.sums else self.sums[name] + v

    def reduce(self, num_steps: int, with_plugins: bool) -> tuple[dict[str, float], float]:
        """Sum over all ranks (those that report none add 0): ``(stats by name, tokens)``. A
        stat is reported when some rank produced it; step stats become means over the optimizer
        steps, the rollout sums means over the rollout tokens. ``with_plugins`` (the same on every
        rank): a plugin's stats of other names are gathered too."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        seen = [float(n in self.sums) for n in _BUILTIN_STATS] + [float(self.tokens)]
        vec = torch.cat([torch.stack([self.sums.get(n, zero) for n in _BUILTIN_STATS]),
                         torch.tensor(seen, dtype=torch.float64, device=self.device)])
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world > 1:
            dist.all_reduce(vec)
        values = vec.tolist()
        n = len(_BUILTIN_STATS)
        total = {name: v for name, v, present in zip(_BUILTIN_STATS, values[:n], values[n:2 * n]) if present > 0}
        out = {name: total[name] / num_steps for name in STEP_MEAN_STATS if name in total}
        if with_plugins:  # names only a plugin knows, maybe not on every rank: gathered as objects
            mine = {name: float(v) for name, v in self.sums.items() if name not in _BUILTIN_STATS}
            extra: list[Any] = [mine]
            if world > 1:
                extra = [None] * world
                dist.all_gather_object(extra, mine)
            summed: dict[str, float] = {}
            for part in extra:
                for name, v in part.items():
                    summed[name] = summed.get(name, 0.0) + v
            out.update({name: summed[name] / num_steps for name in sorted(summed) if name[0] != "_"})
        if total.get(ROLLOUT_COUNT, 0.0) > 0:
            out.update({name: total[name] / total[ROLLOUT_COUNT] for name in ROLLOUT_SUM_STATS})
        return out, values[-1]
