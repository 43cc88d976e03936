"""The learning-rate schedule (per optimizer step): linear warm-up, then constant, linear or
cosine decay from ``--lr`` to ``--min-lr`` over ``--lr-decay-iters``, or Megatron's WSD: ``--lr``
until the last ``--lr-wsd-decay-iters`` steps before ``--lr-decay-iters``, then a decay to
``--min-lr`` (Megatron's ``OptimizerParamScheduler.get_lr`` formulas)."""

from __future__ import annotations

import math

from train_backend.settings import TrainSettings


def learning_rate(settings: TrainSettings, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based)."""
    s = settings
    if step < s.lr_warmup_steps:
        # (step + 1): the first step already moves the weights (a 0 learning rate wastes a rollout)
        return s.lr * (step + 1) / s.lr_warmup_steps
    if s.lr_decay_style == "constant":
        return s.lr
    assert s.lr_decay_steps is not None  # validated by TrainSettings
    if s.lr_decay_style == "WSD":
        assert s.lr_wsd_decay_steps is not None  # validated by TrainSettings
        anneal_start = s.lr_decay_steps - s.lr_wsd_decay_steps
        if step <= anneal_start:
            return s.lr
        ratio = min(1.0, (step - anneal_start) / s.lr_wsd_decay_steps)
        coeff = {"linear": lambda r: 1.0 - r,
                 "cosine": lambda r: 0.5 * (1.0 + math.cos(math.pi * r)),
                 "exponential": lambda r: 2.0 * 0.5 ** r - 1.0,
                 "minus_sqrt": lambda r: 1.0 - math.sqrt(r)}[s.lr_wsd_decay_style](ratio)
        return s.min_lr + (s.lr - s.min_lr) * coeff
    span = max(1, s.lr_decay_steps - s.lr_warmup_steps)
    progress = min(1.0, (step - s.lr_warmup_steps) / span)
    if s.lr_decay_style == "linear":
        return s.min_lr + (s.lr - s.min_lr) * (1.0 - progress)
    return s.min_lr + (s.lr - s.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_factor(settings: TrainSettings):
    """``LambdaLR``'s multiplier of ``--lr`` at each step."""
    return lambda step: learning_rate(settings, step) / settings.lr
