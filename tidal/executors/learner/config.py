"""The options of a model trained on prompt groups (one pydantic class, defaults a user can run with),
shared by the trainer and the critic."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tidal.modeling.optim_config import OptimConfig


class LearnerConfig(BaseModel):
    """Layout, optimizer and micro-batches of a model trained on prompt groups (the trainer's policy, the
    critic's value model); each executor's config class derives from it with its own defaults."""

    model_config = ConfigDict(extra="forbid")
    dp: int = Field(1, ge=1, description="data-parallel units; group i trains on unit i % dp")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks per unit (must divide heads, kv heads, "
                    "intermediate size and vocabulary)")
    cp: int = Field(1, ge=1, description="context-parallel ranks per unit (trainer, torch backend): a packed row's "
                    "tokens split over them, attention over the row's keys gathered each layer; to the weights' "
                    "layout they are dp copies (tidal/modeling/parallel/cp.py)")
    fsdp: bool = Field(False, description="shard the model and its copies over dp (x cp) with FSDP2 (else dp replicates)")
    ep: int = Field(1, ge=1, description="expert parallel (mixture-of-experts models): each group of ep dp ranks "
                    "splits the experts, ep ranks holding experts/ep each; tokens reach their experts by "
                    "all-to-all (must divide dp and the experts; tp 1, no fsdp)")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="bf16: forward and backward in bfloat16 on a bf16 copy of fp32 master weights (the "
        "optimizer steps the fp32 weights; FSDP2's mixed precision with fsdp); fp16: the same in float16, "
        "with a dynamic loss scale (trainer only; trainer.loss_scale)")
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0, description="AdamW eps")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from lr/(warmup+1)")
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    grad_clip: float = Field(1.0, gt=0, description="max global grad norm")
    shared_prompt: Literal["on", "off", "auto", "padded"] = Field(
        "auto", description="on: a group is one packed row [prompt, r_1..r_G] (prompt trained once); off: "
        "varlen packing, no padding; auto: on when sharing saves >= 5% of the tokens; padded: the unpacked "
        "reference ([prompt, r_i] rows padded, micro_batch_size rows per micro-batch)")
    @field_validator("shared_prompt", mode="before")
    @classmethod
    def _yaml_on_off(cls, value):
        # YAML 1.1 reads bare on/off as booleans (in config files and --set alike)
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    activation_checkpointing: bool = Field(False, description="recompute each decoder layer's activations "
                                           "in the backward: ~1/3 more compute, one layer's activations kept")
    logprob_chunk: int = Field(1024, ge=0, description="response tokens per LM-head chunk: log-probs and "
                               "entropy never hold [tokens, vocab] logits beyond a chunk (recomputed in the "
                               "backward); 0: all at once")
    token_budget: int = Field(4096, ge=1, description="tokens per packed micro-batch (a group splits by sample index)")
    micro_batch_size: int = Field(8, ge=1, description="sequences per micro-batch with shared_prompt=padded")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per epoch over the batch; group i "
                              "is in mini-batch (i // dp) % mini_batches")
    epochs: int = Field(1, ge=1, description="passes over the batch (PPO-style); >1 uses the old-policy snapshot")
    fp64_grad_accumulation: bool = Field(False, description="accumulate grads in float64 (8 bytes a "
                                         "parameter per loss pass), added as groups arrive; off: float32, "
                                         "added in group-index order whatever the arrival order, so sync and "
                                         "periodic still agree bit for bit")
    grad_spares: int = Field(1, ge=0, description="float32 accumulation: groups that may train ahead of their "
                             "turn, their gradients held (one gradient-sized buffer per micro-batch and loss "
                             "pass) until the groups before them are in; 0: groups train in index order")

    @property
    def lockstep(self) -> bool:
        """dp units go in lockstep rounds: FSDP shards one copy over them, or expert parallel makes every
        forward an all-to-all over them (tidal/executors/learner/order.py)."""
        return self.dp > 1 and (self.fsdp or self.ep > 1)

    @property
    def shards_over_units(self) -> bool:
        """The dp units (and their cp ranks) hold shards of one copy (FSDP), not replicas: no gradient sum over
        dp at the step."""
        return self.fsdp and self.dp * self.cp > 1

    @property
    def stages(self) -> int:
        """Pipeline stages per dp unit (the trainer's trainer.pp; 1 here)."""
        return 1

    @property
    def ranks_per_unit(self) -> int:
        """The ranks one dp unit spans: tp per stage, or tp per context-parallel rank."""
        return self.tp * self.stages * self.cp

    @property
    def index_ordered(self) -> bool:
        """A rank takes its groups in index order (its tp peers and pipeline stages, or its lockstep round,
        must take the same), never in arrival order: nothing is held for float32 sums (IndexOrderedSum)."""
        return self.ranks_per_unit > 1 or self.lockstep

    @property
    def optim(self) -> OptimConfig:
        """What the optimizer reads of these options (tidal/modeling/optim.py)."""
        return OptimConfig(lr=self.lr, betas=self.betas, eps=self.adam_eps, weight_decay=self.weight_decay,
                           warmup_steps=self.warmup_steps, schedule=self.lr_schedule, min_lr_ratio=self.min_lr_ratio,
                           grad_clip=self.grad_clip, fp64_accumulation=self.fp64_grad_accumulation)


