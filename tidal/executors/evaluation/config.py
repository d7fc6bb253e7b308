"""The evaluation's options (pydantic): light, the CLI and --dry-run import them without model code."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EvalConfig(BaseModel):
    """Evaluation on held-out prompts, a phase of the step on the generator's and the reward's ranks (docs/models-and-data.md, Evaluation)."""

    model_config = ConfigDict(extra="forbid")
    every: int = Field(0, ge=0, description="evaluate at steps 0, N, 2N, ... with the weights that step samples "
                       "with; 0: never")
    path: str | None = Field(None, description="held-out JSONL/Parquet, columns as data.prompt_key/answer_key; "
                             "None: the embedded task's held-out split (embedded task only)")
    prompts: int = Field(64, ge=1, description="the embedded split's size; with a file, its first N prompts")
    samples: int = Field(1, ge=1, description="k responses per prompt; pass@k is logged when k > 1")
    temperature: float = Field(0.0, ge=0, description="0: greedy")
    max_new_tokens: int | None = Field(None, ge=1, description="None: generator.max_new_tokens")
    pass_threshold: float = Field(1.0, description="a response solves its prompt when its reward is at least this")
