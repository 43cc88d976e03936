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




# --- written to equal Reservoir's built-in path (the tests compare the trained weights) ----------

def grpo_advantages(args, rollout_data):
    """slime's grpo advantage: the normalised reward on every token."""
    rollout_data["advantages"] = [torch.full_like(lp, r) for lp, r in
                                  zip(rollout_data["log_probs"], rollout_data["rewards"])]


def ppo_loss(args, batch, logits, sum_of_sample_mean):
    """The clipped PPO loss alone, from slime's helpers."""
    _, out = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                       total_lengths=batch["total_lengths"],
                                       response_lengths=batch["response_lengths"])
    log_probs = torch.cat(out["log_probs"])
    old = torch.cat(batch["log_probs"]) if "log_probs" in batch else log_probs.detach()
    pg, clipfrac = compute_policy_loss(old - log_probs, torch.cat(batch["advantages"]), args.eps_clip, args.eps_clip)
    loss = sum_of_sample_mean(pg)
    return loss, {"pg_loss": loss.detach(), "custom_clipfrac": sum_of_sample_mean(clipfrac).detach()}


def grpo_rewards(args, samples):
    """slime's default reward post-process for grpo: each group's rewards, centred and scaled."""
    raw = [s.get_reward_value(args) for s in samples]
    out = [0.0] * len(samples)
    for g in {s.group_index for s in samples}:
        idx = [i for i, s in enumerate(samples) if s.group_index == g]
        r = torch.tensor([raw[i] for i in idx], dtype=torch.float64)
        r = r - r.mean()
        for i, v in zip(idx, (r / (r.std() + 1e-6)).tolist()):
            out[i] = v
    return raw, out


def train_data_first_token_masked(args, samples):
    """slime's conversion with each sample's first response token out of the loss."""
    raw, rewards = grpo_rewards(args, samples)
    return {"tokens": [s.tokens for s in samples], "response_lengths": [s.response_length for s in samples],
            "rewards": rewards, "raw_reward": raw, "loss_masks": [[0] + s.loss_mask[1:] for s in samples],
            "sample_indices": [s.index for s in samples]}


def double_advantages_mask_first_token(args, rollout_id, rollout_data):
    """A rollout-data post-process: advantages doubled, each first response token out of the loss."""
    rollout_data["advantages"] = [2 * a for a in rollout_data["advantages"]]
    for m in rollout_data["loss_masks"]:
        m[0] = 0
    POSTPROCESSED.append(rollout_id)


POSTPROCESSED = []  # rollout ids the post-process saw, read by the test in the same process


PROVIDED = []  # (pre_process, post_process, vp_stage) of each call, read in the same process


def gpt_provider(pre_process, post_process, vp_stage=None):
    """A model provider in slime's signature building megatron-core's GPTModel for the checkpoint
    in $RESERVOIR_TEST_HF (slime's would read megatron's global args instead)."""
    import os

    from megatron.core import parallel_state
    from transformers import AutoConfig

    from train_backend.megatron import model as mmodel

    PROVIDED.append((pre_process, post_process, vp_stage))
    hf = AutoConfig.from_pretrained(os.environ["RESERVOIR_TEST_HF"])
    tp = parallel_state.get_tensor_model_parallel_world_size()
    dims = mmodel.dims_from_hf(hf, 128, tp)
    config = mmodel.transformer_config(dims, params_dtype=torch.float32, tp_size=tp, pp_size=1,
                                       sequence_parallel=False, on_cpu=True)
    return mmodel.build_gpt_model(dims, config, hf, use_te=False)


def recorded_grpo_rewards(args, samples):
    """:func:`grpo_rewards`, recording its call (for runs through the launcher)."""
    _record(args, hook="reward_post_process", n=len(samples), slime_sample=type(samples[0]).__name__)
    return grpo_rewards(args, samples)


def recorded_postprocess(args, rollout_id, rollout_data):
    """A rollout-data post-process that only records what it was given."""
    _record(args, hook="postprocess", rollout_id=rollout_id, keys=sorted(rollout_data),
            n=len(rollout_data["advantages"]))


def raising_postprocess(args, rollout_id, rollout_data):
    """A post-process with a bug."""
    return rollout_data["no_such_key"]
