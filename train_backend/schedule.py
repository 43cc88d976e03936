"""The learning-rate schedule (per optimizer step): linear warm-up, then constant, linear or
cosine decay from ``--lr`` to ``--min-lr`` over ``--lr-decay-steps``."""

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
    span = max(1, s.lr_decay_steps - s.lr_warmup_steps)
    progress = min(1.0, (step - s.lr_warmup_steps) / span)
    if s.lr_decay_style == "linear":
        return s.min_lr + (s.lr - s.min_lr) * (1.0 - progress)
    return s.min_lr + (s.lr - s.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_factor(settings: TrainSettings):
    """``LambdaLR``'s multiplier of ``--lr`` at each step."""
    return lambda step: learning_rate(settings, step) / settings.lr
