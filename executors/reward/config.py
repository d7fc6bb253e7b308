"""The reward executor's options (light: the CLI and --dry-run import it without model code)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


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

    @model_validator(mode="after")
    def _weights_match(self):
        if self.weights is not None and (self.functions is None or len(self.weights) != len(self.functions)):
            raise ValueError("reward.weights needs one weight per entry of reward.functions")
        return self
