"""Trainer-side hooks in slime's style (written for the tests): each records its call, with what
it was given, as one JSON line in ``args.hook_log`` (set through ``--custom-config-path``)."""

import json

import torch

from slime.backends.megatron_utils.loss import get_log_probs_and_entropy
from slime.utils.ppo_utils import compute_approx_kl, compute_policy_loss


def _record(args, **event):
    with open(args.hook_log, "a") as f:
        f.write(json.dumps(event) + "\n")


def custom_init(args):
    _record(args, hook="init", tag=args.hook_tag, kl_loss_type=args.kl_loss_type)


def before_log_prob(args, model, store_prefix):
    _record(args, hook="before_log_prob", prefix=store_prefix, model=type(model[0]).__name__,
            training=bool(model[0].training))


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    _record(args, hook="before_train_step", rollout_id=rollout_id, step_id=step_id, model=type(model[0]).__name__,
            optimizer=type(optimizer).__name__)


def advantages(args, rollout_data):
    """slime's grpo: the (normalised) reward on every token; doubled, so the test can see it."""
    rollout_data["advantages"] = [torch.full_like(lp, 2.0 * r) for lp, r in
                                  zip(rollout_data["log_probs"], rollout_data["rewards"])]
    rollout_data["returns"] = rollout_data["advantages"]
    _record(args, hook="advantage", n=len(rollout_data["rewards"]), has_ref="ref_log_probs" in rollout_data,
            lengths_ok=all(len(lp) == r for lp, r in zip(rollout_data["log_probs"], rollout_data["response_lengths"])))


def policy_loss(args, batch, logits, sum_of_sample_mean):
    """A PPO loss written as slime users write them, with a KL term."""
    _, out = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                       total_lengths=batch["total_lengths"],
                                       response_lengths=batch["response_lengths"], with_entropy=True)
    log_probs = torch.cat(out["log_probs"])
    old = torch.cat(batch["log_probs"]) if "log_probs" in batch else log_probs.detach()
    ppo_kl = old - log_probs
    pg, clipfrac = compute_policy_loss(ppo_kl, torch.cat(batch["advantages"]), args.eps_clip, args.eps_clip)
    loss = sum_of_sample_mean(pg)
    metrics = {"pg_loss": loss.detach(), "custom_clipfrac": sum_of_sample_mean(clipfrac)}
    if "ref_log_probs" in batch:
        kl = compute_approx_kl(log_probs, torch.cat(batch["ref_log_probs"]), args.kl_loss_type)
        loss = loss + args.kl_loss_coef * sum_of_sample_mean(kl)
        metrics["kl"] = sum_of_sample_mean(kl).detach()
    _record(args, hook="loss", samples=len(batch["response_lengths"]))
    return loss, {"loss": loss.detach(), **metrics}


def tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """Rejects the tokens whose train/rollout ratio leaves [0.5, 2]; weights the rest."""
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    keep = ((ratio >= 0.5) & (ratio <= 2.0)).float()
    masks = [m * k for m, k in zip(loss_masks, torch.split(keep, [len(m) for m in loss_masks]))]
    _record(args, hook="tis", samples=len(loss_masks), total_lengths=kwargs["total_lengths"] is not None)
    return pg_loss * ratio.clamp(max=2.0), masks, {"custom_tis": ratio}


REDUCED = []  # (samples, per-token loss) of each reduction, read by the test in the same process


def dr_grpo_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    """Dr. GRPO: each sample's token sum over a constant (slime's documented use of this hook)."""
    def reduce(x):
        REDUCED.append((len(response_lengths), calculate_per_token_loss))
        return torch.stack([(t * m).sum() / 16.0 for t, m in zip(torch.split(x, response_lengths), loss_masks)]).sum()
    return reduce


