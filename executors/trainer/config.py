"""The trainer's options: the layout, optimizer and micro-batches of the policy (executors/training/config.py)."""
from __future__ import annotations

from executors.training.config import LearnerConfig, lr_factor

__all__ = ["TrainerConfig", "lr_factor"]


class TrainerConfig(LearnerConfig):
    """The policy's trainer. Its copies (old policy, reference) share its layout; with precision=bf16 the
    generator runs in bf16 too (its pushes are cast once, on the trainer's side)."""
