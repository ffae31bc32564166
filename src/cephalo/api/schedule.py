"""The learning-rate schedule (pure: the trainer steps by it, `cephalo run --resume` says
how a changed `training` moves it)."""

from __future__ import annotations

import math

from cephalo.api.job import TrainingSpec


def learning_rate(spec: TrainingSpec, step: int) -> float:
    """LR for optimizer step `step` (0-based): linear warm-up, then the schedule down to
    `min_learning_rate_ratio` x peak at the last step."""
    peak = spec.learning_rate
    if step < spec.warmup_steps:
        return peak * (step + 1) / spec.warmup_steps
    if spec.schedule == "constant":
        return peak
    decay_steps = max(1, spec.steps - spec.warmup_steps - 1)
    progress = min(1.0, (step - spec.warmup_steps) / decay_steps)
    floor = peak * spec.min_learning_rate_ratio
    if spec.schedule == "linear":
        return peak - (peak - floor) * progress
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
