"""The optimizer's options and its lr schedule: light, so that the CLI and --dry-run read them without
loading the optimizer (tidal/modeling/optim.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW, its lr schedule, clipping and the accumulators' precision (a learner's config gives its own:
    tidal/executors/learner/config.py LearnerConfig.optim)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0  # linear warm-up from lr / (warmup + 1)
    schedule: str = "constant"  # or "cosine", down to min_lr_ratio x lr at the last step
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global gradient norm
    fp64_accumulation: bool = False  # float64 accumulators (the learner orders float32 sums by index)


def lr_factor(step: int, *, warmup: int, schedule: str, total: int, floor: float) -> float:
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
