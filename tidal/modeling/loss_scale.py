"""Dynamic loss scaling for trainer.precision=fp16.

fp16 has 5 exponent bits: gradients under ~6e-8 flush to zero in its backward, and a loss of a few
thousand token log-probs (the trainer's losses are sums, divided once at the barrier) overflows it
above 65504. Scaling the loss by S before the backward moves the gradients up into fp16's range; the
fp32 accumulators then hold S x the gradient, and the barrier divides by S together with the batch
denominator. An overflow anywhere shows as a non-finite gradient norm: that step is skipped (no AdamW
update, no moment change) and S halves; after `window` steps without one S doubles.

Not torch.amp.GradScaler: it unscales and checks each rank's own `.grad` and steps the optimizer
itself, while here gradients live in fp32 accumulators and the clipping norm is already summed over
every dp, tp and FSDP shard (tidal/modeling/parallel clip_grad_norm_), so one non-finite norm is the decision
every rank shares without another collective.
"""
from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field


class LossScaleConfig(BaseModel):
    """The loss scale of trainer.precision=fp16 (unused in fp32 and bf16, whose range needs none)."""

    model_config = ConfigDict(extra="forbid")
    # the trainer's losses are sums over a micro-batch's tokens (divided once, at the barrier), so its
    # gradients are already large: the embedded model's largest entry at scale 1 was 3.2, and torch's
    # GradScaler's 2**16 overflowed on step 0 there; 2**8 leaves a decade of headroom, and grows
    init: float = Field(2.0**8, gt=0, description="the first scale")
    window: int = Field(200, ge=1, description="optimizer steps without an overflow before the scale doubles "
                        "(an RL run takes hundreds of steps, each costly to skip: megatron's 1000 would never grow)")
    min: float = Field(1.0, gt=0, description="the scale never halves below this")


class LossScaler:
    """S, and how many optimizer steps it has held without an overflow; both go into checkpoints, so a
    resumed run skips and scales exactly as an uninterrupted one."""

    def __init__(self, cfg: LossScaleConfig):
        self.cfg, self.scale, self.good_steps, self.skipped = cfg, cfg.init, 0, 0

    def update(self, grad_norm: float) -> bool:
        """After the backward of a step whose (unscaled) gradient norm is `grad_norm`: whether to step."""
        if not math.isfinite(grad_norm):
            self.scale, self.good_steps, self.skipped = max(self.cfg.min, self.scale / 2), 0, self.skipped + 1
            return False
        self.good_steps += 1
        if self.good_steps == self.cfg.window:
            self.scale, self.good_steps = self.scale * 2, 0
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.skipped = state["scale"], state["good_steps"], state["skipped"]
