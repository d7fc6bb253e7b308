"""The trainer's options: the layout, optimizer and micro-batches of the policy (executors/training/config.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from executors.training.config import LearnerConfig, lr_factor

__all__ = ["TrainerConfig", "lr_factor"]


class TrainerConfig(LearnerConfig):
    """The policy's trainer. Its copies (old policy, reference) share its layout; with precision=bf16 the
    generator runs in bf16 too (its pushes are cast once, on the trainer's side)."""

    backend: Literal["torch", "megatron"] = Field(
        "torch", description="torch: HF model classes with DTensor tp and FSDP2; megatron: megatron-core's "
        "GPTModel (the megatron extra; Qwen3/Qwen2/Llama), tp, and dp with a ZeRO-1 optimizer")

    @model_validator(mode="after")
    def _megatron_limits(self):
        if self.backend == "megatron":
            if self.fsdp:
                raise ValueError("trainer.fsdp: the megatron backend shards the optimizer over dp itself; "
                                 "set trainer.fsdp=false")
        return self
