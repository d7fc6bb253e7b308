"""The trainer's options: the layout, optimizer and micro-batches of the policy (tidal/executors/learner/config.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from tidal.modeling.lora import LoraConfig
from tidal.modeling.loss_scale import LossScaleConfig
from tidal.executors.learner.config import LearnerConfig


class TrainerConfig(LearnerConfig):
    """The policy's trainer. Its copies (old policy, reference) share its layout; with precision=bf16 or
    fp16 the generator runs in that dtype too (its pushes are cast once, on the trainer's side)."""

    backend: str = Field(
        "torch", description="torch: HF model classes with DTensor tp and FSDP2; megatron: megatron-core's "
        "GPTModel (the megatron extra; Qwen3/Qwen2/Llama), tp, and dp with a ZeRO-1 optimizer "
        "(tidal/executors/trainer/backends.py registers them)")

    pp: int = Field(1, ge=1, description="pipeline-parallel stages per unit (megatron backend): each holds "
                    "layers/pp decoder layers; a unit is tp x pp ranks, and the groups stream through the "
                    "stages as micro-batches, 1F1B across groups (tidal/modeling/megatron/pipeline.py)")
    pp_drain: Literal["step", "group"] = Field(
        "step", description="pp > 1: when the pipeline drains: step: once, at the barrier (1F1B across the "
        "step's groups); group: after each group (its activations freed sooner; more bubble)")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters on a frozen base (rank > 0): "
                             "adapters alone train and are pushed (tidal/modeling/lora.py)")
    routing_replay: bool = Field(
        False, description="mixture-of-experts models: route each token through the experts the generator "
        "used (recorded by the native engine) instead of the trainer's own top-k; either way metrics report "
        "routing_mismatch_frac, the tokens whose own choice differed (tidal/modeling/moe.py)")
    loss_scale: LossScaleConfig = Field(default_factory=LossScaleConfig, description="precision=fp16's dynamic "
                                        "loss scale: a step that overflows is skipped and the scale halves "
                                        "(tidal/modeling/loss_scale.py)")

    @property
    def stages(self) -> int:
        return self.pp
