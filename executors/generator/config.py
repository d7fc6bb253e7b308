"""The generator's options, and the model and data sections it reads (pydantic, defaults a user can run with).

Light on purpose: the CLI and --dry-run import these without any model code.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = Field(None, description="HF model directory; None = the embedded tiny Qwen3")
    dtype: Literal["float32", "bfloat16"] = "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = Field(None, description="JSONL or Parquet with a `prompt` column; None = embedded task")
    prompts_per_step: int = Field(8, ge=1, description="B: prompt groups per optimizer step")
    max_prompt_tokens: int = Field(256, ge=1, description="longer prompts are dropped (counted), never cut")
    chat_template: bool = Field(False, description="apply the tokenizer's chat template to each prompt")
    embedded_prompts: int = Field(4096, ge=1, description="size of the generated embedded prompt set")


class GeneratorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: int = Field(1, ge=1, description="generator data-parallel replicas")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks per replica (independent of trainer.tp)")
    samples_per_prompt: int = Field(16, ge=1, description="G: responses sampled per prompt")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(8, ge=1)
    max_batch_prompts: int = Field(16, ge=1, description="prompts decoded together in one inference chunk")
    engine: Literal["native"] = "native"
