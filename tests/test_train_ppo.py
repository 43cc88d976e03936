"""PPO with a critic (``--advantage-estimator ppo``): token-level rewards, GAE and the clipped value
loss against independent implementations (OpenRLHF's and slime's functions, written out below
with their sources: neither runs in CI), then the torch backend's critic training the toy task."""

from __future__ import annotations

import pytest
import torch

from train_backend.losses import LossDenominators, aggregate, gae, token_level_rewards, value_loss

TOL = 1e-12  # float64 throughout: the same arithmetic in another order


# --- the references, written out --------------------------------------------------------------
def openrlhf_get_advantages_and_returns(values, rewards, action_mask, gamma, lambd):
    """OpenRLHF/OpenRLHF openrlhf/trainer/ppo_utils/experience_maker.py (commit 01359b46),
    ``NaiveExperienceMaker.get_advantages_and_returns``, the padded-batch path."""
    lastgaelam = 0
    advantages_reversed = []
    response_length = rewards.size(1)
    if action_mask is not None:
        values = action_mask * values
        rewards = action_mask * rewards
    for t in reversed(range(response_length)):
        nextvalues = values[:, t + 1] if t < response_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lambd * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return advantages.detach(), returns


def openrlhf_value_loss(values, old_values, returns, action_mask, clip_eps):
    """OpenRLHF/OpenRLHF openrlhf/models/loss.py (commit 09f5acef), ``ValueLoss.forward`` with
    ``token_level_loss=True`` (``masked_mean`` over every token of the batch)."""
    values_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    surr1 = (values_clipped - returns) ** 2
    surr2 = (values - returns) ** 2
    loss = torch.max(surr1, surr2)
    loss = (loss * action_mask).sum() / action_mask.sum()
    return 0.5 * loss


def slime_ppo_token_rewards(rewards, kl, kl_coef):
    """slime 624b824 slime/backends/megatron_utils/loss.py lines 769-778 (the ``ppo`` branch of
    ``compute_advantages_and_returns``, context parallelism off: cp_rank 0)."""
    out = []
    for reward, per_token_kl in zip(rewards, kl, strict=False):
        token_level_rewards = per_token_kl * -kl_coef
        token_level_rewards[-1] += reward
        out.append(token_level_rewards)
    return out


def slime_value_loss_terms(values, old_values, returns, value_clip):
    """slime 624b824 slime/backends/megatron_utils/loss.py lines 1212-1215 (``value_loss_function``,
    before its ``sum_of_sample_mean``)."""
    values_clipfrac = torch.abs(values - old_values) > value_clip
    values_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    surr1 = (values_clipped - returns) ** 2
    surr2 = (values - returns) ** 2
    return torch.max(surr1, surr2), values_clipfrac.float()


# --- the pure functions -----------------------------------------------------------------------
def _random_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 1, 9, 3, 7]
    n = sum(lengths)
    return (lengths, torch.randn(len(lengths), generator=gen, dtype=torch.float64),
            torch.randn(n, generator=gen, dtype=torch.float64), torch.rand(n, generator=gen, dtype=torch.float64))


def test_token_level_rewards_equal_slimes_ppo_rewards():
    lengths, rewards, values, kl = _random_batch()
    for kl_coef in (0.0, 0.05):
        ours = token_level_rewards(rewards, lengths, kl, kl_coef)
        theirs = torch.cat(slime_ppo_token_rewards(rewards.tolist(), [k.clone() for k in torch.split(kl, lengths)],
                                                   kl_coef))
        assert torch.allclose(ours, theirs, atol=TOL, rtol=0)
    plain = token_level_rewards(rewards, lengths)  # no KL: the reward alone, on the last token
    ends = torch.cumsum(torch.tensor(lengths), 0) - 1
    assert torch.equal(plain[ends], rewards) and torch.isclose(plain.abs().sum(), rewards.abs().sum())


def test_gae_equals_openrlhf_on_padded_sequences():
    lengths, rewards, values, kl = _random_batch(1)
    r = token_level_rewards(rewards, lengths, kl, 0.1)
    width = max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float64)  # [S, T]
    for gamma, lambd in ((1.0, 1.0), (1.0, 0.95), (0.99, 0.9), (0.5, 0.0)):
        adv, ret = gae(r, values, lengths, gamma, lambd)
        # OpenRLHF's padded batch: right padding, masked by action_mask (what pad_sequence makes)
        pr = torch.nn.utils.rnn.pad_sequence(list(torch.split(r, lengths)), batch_first=True)
        pv = torch.nn.utils.rnn.pad_sequence(list(torch.split(values, lengths)), batch_first=True)
        a_ref, r_ref = openrlhf_get_advantages_and_returns(pv, pr, mask, gamma, lambd)
        assert torch.allclose(adv, a_ref[mask > 0], atol=TOL, rtol=0), (gamma, lambd)
        assert torch.allclose(ret, r_ref[mask > 0], atol=TOL, rtol=0), (gamma, lambd)
        # and each sequence alone (OpenRLHF's packed-samples path)
        for k, (rk, vk) in enumerate(zip(torch.split(r, lengths), torch.split(values, lengths))):
            a1, _ = openrlhf_get_advantages_and_returns(vk[None], rk[None], None, gamma, lambd)
            assert torch.allclose(torch.split(adv, lengths)[k], a1[0], atol=TOL, rtol=0)


def test_gae_by_hand():
    # gamma = lambda = 1: every token's return is the sequence reward, its advantage reward - value
    adv, ret = gae(torch.tensor([0.0, 0.0, 1.0, 2.0]), torch.tensor([0.5, 0.25, 0.75, 1.5]), [3, 1], 1.0, 1.0)
    assert torch.allclose(ret, torch.tensor([1.0, 1.0, 1.0, 2.0]))
    assert torch.allclose(adv, torch.tensor([0.5, 0.75, 0.25, 0.5]))
    # lambda = 0: the one-step TD error
    adv, _ = gae(torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.25]), [2], 0.9, 0.0)
    assert torch.allclose(adv, torch.tensor([0.9 * 0.25 - 0.5, 1.0 - 0.25]))


def test_value_loss_equals_slime_and_openrlhf():
    lengths, _, returns, _ = _random_batch(2)
    gen = torch.Generator().manual_seed(3)
    old = returns + 0.5 * torch.randn(returns.shape, generator=gen, dtype=torch.float64)
    new = old + 0.4 * torch.randn(returns.shape, generator=gen, dtype=torch.float64)  # some beyond the clip
    mask = (torch.rand(returns.shape, generator=gen) > 0.2).to(torch.float64)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    for clip in (0.2, 0.05, 10.0):
        loss, clipped = value_loss(new, old, returns, clip)
        ref_loss, ref_clipped = slime_value_loss_terms(new, old, returns, clip)
        assert torch.allclose(loss, ref_loss, atol=TOL, rtol=0) and torch.equal(clipped, ref_clipped)
        assert 0 < clipped.mean() < 1 or clip == 10.0
        denom = LossDenominators.of_batch(mask, seq_ids, len(lengths))
        token_mean = aggregate(loss, mask, "token_mean", seq_ids, len(lengths), denom)
        # OpenRLHF halves the loss (its gradient is then (V - R), ours 2 (V - R), as slime's)
        assert abs(float(token_mean) - 2 * float(openrlhf_value_loss(new, old, returns, mask, clip))) < TOL


# --- the torch backend's critic on the toy task -------------------------------------------------
def _ppo_backend(model_dir, **kw):
    from _fixtures_train import settings
    from train_backend import create_backend

    kw.setdefault("critic_lr", 3e-3)
    return create_backend(settings(model_dir, advantage_estimator="ppo", **kw))


def test_critic_values_move_toward_returns_and_the_policy_trains(toy_model_dir):
    from _fixtures_train import make_groups, weights

    groups = make_groups(toy_model_dir, num_groups=4, group_size=8)
    samples = [s for g in groups for s in g]
    b = _ppo_backend(toy_model_dir)
    # gamma = lambda = 1: every token's return is its sample's reward
    def value_error() -> float:
        values = b.critic.values(samples)
        return sum((v - s.reward) ** 2 for s, vs in zip(samples, values) for v in vs) / sum(
            s.response_length for s in samples)

    before, w0 = value_error(), weights(b)
    assert all(v == 0 for vs in b.critic.values(samples) for v in vs)  # the zero-initialised head
    metrics = [b.train_step(groups, k) for k in range(6)]
    after = value_error()
    losses = [m["train/value_loss"] for m in metrics]
    # measured: value loss 0.37 -> 0.21 in 8 steps; squared error to the returns 0.37 -> ~0.2
    assert losses[-1] < 0.8 * losses[0], losses
    assert after < 0.8 * before, (before, after)
    assert all(m["train/critic_grad_norm"] > 0 and m["train/critic_lr"] == 3e-3 for m in metrics)
    assert any(not torch.equal(w0[k], v) for k, v in weights(b).items())  # the policy trained too
    # the first step's advantages were the rewards on every token (values 0, ratio 1): its policy
    # loss is minus their token mean
    tokens = sum(s.response_length for s in samples)
    assert abs(metrics[0]["train/pg_loss"] + sum(s.reward * s.response_length for s in samples) / tokens) < 1e-5


def test_critic_only_steps_leave_the_policy(toy_model_dir):
    from _fixtures_train import make_groups, weights

    groups = make_groups(toy_model_dir, num_groups=2, group_size=4)
    b = _ppo_backend(toy_model_dir, num_critic_only_steps=1)
    w0 = weights(b)
    m = b.train_step(groups, 0)
    assert "train/pg_loss" not in m and m["train/value_loss"] > 0
    assert all(torch.equal(w0[k], v) for k, v in weights(b).items())
    assert "train/pg_loss" in b.train_step(groups, 1)


def test_critic_checkpoint_resumes_exactly(toy_model_dir, tmp_path):
    from _fixtures_train import make_groups

    groups = make_groups(toy_model_dir, num_groups=2, group_size=4)
    samples = [s for g in groups for s in g]
    a = _ppo_backend(toy_model_dir, lr_decay_style="linear", lr_decay_steps=4)
    a.train_step(groups, 0)
    a.save(str(tmp_path / "ckpt"))
    m1 = a.train_step(groups, 1)
    b = _ppo_backend(toy_model_dir, lr_decay_style="linear", lr_decay_steps=4)
    b.load(str(tmp_path / "ckpt"))
    m2 = b.train_step(groups, 1)
    for key in ("train/value_loss", "train/critic_grad_norm", "train/critic_lr", "train/pg_loss", "train/loss"):
        assert m1[key] == m2[key], key
    assert a.critic.values(samples) == b.critic.values(samples)
    c = _ppo_backend(toy_model_dir)
    c.save(str(tmp_path / "fresh"))
    from _fixtures_train import settings
    from train_backend import create_backend

    grpo = create_backend(settings(toy_model_dir))
    grpo.save(str(tmp_path / "grpo"))
    with pytest.raises(RuntimeError, match="holds no critic"):
        c.load(str(tmp_path / "grpo"))


def test_ppo_flags_are_checked_by_name(toy_model_dir):
    from _fixtures_train import settings
    from flags import SettingError

    with pytest.raises(SettingError, match="critic_lr"):
        settings(toy_model_dir, critic_lr=1e-4)  # without ppo
    with pytest.raises(SettingError, match="backend"):
        settings(toy_model_dir, advantage_estimator="ppo", backend="megatron")
    with pytest.raises(SettingError, match="value_clip"):
        settings(toy_model_dir, advantage_estimator="ppo", value_clip=0.0)
    with pytest.raises(SettingError, match="gamma"):
        settings(toy_model_dir, gamma=0.9)
