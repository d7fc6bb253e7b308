"""The reward executor's options (light: the CLI and --dry-run import it without model code)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class CombineConfig(BaseModel):
    """CombineRewards' options: reward = rule_weight * the reward's score + model_weight * the model's."""
    model_config = ConfigDict(extra="forbid")
    replicas: int = Field(1, ge=1, description="combiner replicas; group i goes to replica i % replicas "
                                                "on both inputs, so its two scores always meet")
    rule_weight: float = 1.0
    model_weight: float = 1.0


class RewardModelConfig(BaseModel):
    """`reward.model`: a reward model on its own ranks scores every group beside the reward functions;
    the two scores are summed per sample (CombineRewards, on its own ranks) before the trainer sees them.
    The sum's weights are the functions' `reward.weights` and the model's `scale`."""
    model_config = ConfigDict(extra="forbid")
    replicas: int = Field(1, ge=1, description="reward-model replicas (one rank each)")
    path: str | None = Field(None, description="HF directory of a sequence-classification model (or a "
                                               "causal LM: its head is then new); None = tiny random Qwen3")
    scale: float = Field(1.0, description="reward = scale * logit: the model's weight in the sum")
    seed: int = Field(0, description="initialises the random model or a new head, the same on every rank")
    combine_replicas: int = Field(1, ge=1, description="ranks of the executor that sums the two scores "
                                                        "(launch.py's graph only)")


class RewardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: int = Field(1, ge=1, description="reward replicas (one rank each)")
    functions: list[str] | None = Field(
        None, description="registered names or module:function; default: `embedded` for the embedded "
                          "task, `math_verify` for a data file")
    weights: list[float] | None = Field(None, description="one weight per function (default all 1)")
    timeout_s: float = Field(60.0, gt=0, description="limit of one reward call; past it the call counts as "
                             "failed (on_error decides), naming the reward, prompt and sample")
    on_error: Literal["fail", "zero"] = Field("fail", description="a reward that raises or returns NaN: "
                                              "stop the run, or score 0 and count it")
    max_failed_steps: int = Field(3, ge=0, description="with on_error=zero: stop the run, naming the first "
                                  "error, once every reward of this many steps in a row failed (0: never)")
    model: RewardModelConfig | None = Field(None, description="a reward model on its own ranks, its score added "
                                            "to the functions' (None: none); `--set reward.model.path=DIR` or "
                                            "`--set reward.model={}` adds one")

    @model_validator(mode="after")
    def _weights_match(self):
        if self.weights is not None and (self.functions is None or len(self.weights) != len(self.functions)):
            raise ValueError("reward.weights needs one weight per entry of reward.functions")
        return self
