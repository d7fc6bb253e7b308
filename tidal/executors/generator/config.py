"""The generator's options, and the model and data sections it reads (pydantic, defaults a user can run with).

Light on purpose: the CLI and --dry-run import these without any model code.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tidal.common.config_errors import closest, config_error


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = Field(None, description="HF model directory; None = the embedded tiny Qwen3")
    dtype: Literal["float32", "bfloat16"] = "float32"
    numerics: Literal["default", "exact"] = Field(
        "default", description="exact: batch-invariant products and attention in the native engine and the torch "
                               "trainer, so the sampler's log-probs are the trainer's bit for bit (tidal/modeling/numerics.py); "
                               "default: the library kernels")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = Field(None, description="JSONL or Parquet with a `prompt` column; None = embedded task")
    prompt_key: str = Field("prompt", description="the data file's prompt column (DeepScaleR: problem, GSM8K: question)")
    answer_key: str = Field("answer", description="the column rewards read as sample['answer'] (math_verify)")
    prompts_per_step: int = Field(8, ge=1, description="B: prompt groups per optimizer step")
    max_prompt_tokens: int = Field(256, ge=1, description="longer prompts are dropped (counted), never cut")
    chat_template: bool = Field(False, description="apply the tokenizer's chat template to each prompt")
    embedded_prompts: int = Field(4096, ge=1, description="size of the generated embedded prompt set")

    @property
    def columns(self):
        from tidal.executors.data import Columns

        return Columns(prompt=self.prompt_key, answer=self.answer_key)


# how the native engine admits prompt groups to its slots: the one default of the engine, the config and the planner
ADMISSIONS = ("continuous", "chunked")
DEFAULT_ADMISSION = "continuous"


class GeneratorConfig(BaseModel):
    # besides these fields, the options section of an engine (generator.<its section>, e.g. generator.vllm): each
    # engine declares its own model (tidal/executors/generator/engines.py EngineKind.options), validated here
    model_config = ConfigDict(extra="allow")
    replicas: int = Field(1, ge=1, description="generator data-parallel replicas")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks per replica (independent of trainer.tp)")
    samples_per_prompt: int = Field(16, ge=1, description="G: responses sampled per prompt")
    temperature: float = Field(1.0, ge=0, description="0: greedy (argmax; the log-probs are then those of "
                               "the raw logits, and the trainer's too)")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens only; 0: all")
    max_new_tokens: int = Field(8, ge=1)
    # the embedded job's: 2 slots refilled at once spread the groups' ends over the step, so the
    # trainer starts after ~1/4 of generation (bench/periodic_vs_sync.py); a model.path gets slots
    # chosen from the step's shape and the device (tidal/recipes/defaults.py decode_slots)
    max_batch_prompts: int = Field(2, ge=1, description="prompt groups the native engine decodes at once; with a "
                                   "model.path: waves of ~16 sample rows (CPU, at least 2 per replica) or ~256 "
                                   "(GPU/NPU), so that groups leave while the trainer works")
    kv_budget_tokens: int | None = Field(
        None, ge=1, description="native engine: the most KV positions (slots x each slot's length: the longest prompt "
        "+ max_new_tokens, or + multi_turn.max_total_tokens) a replica's engine may hold; fewer groups then decode at "
        "once and admission waits for their slots (same samples). None: max_batch_prompts' groups")
    kv_memory_fraction: float | None = Field(
        0.9, gt=0, le=1, description="native engine: its KV store takes at most this fraction of the memory free at "
        "its first call (the device's on a GPU/NPU, the host's MemAvailable on CPU); fewer groups then decode at once "
        "and admission waits for their slots (same samples), where a step's slots would not fit. None: unbounded. "
        "vLLM sizes its own (generator.vllm)")
    admission: Literal["chunked", "continuous"] = Field(
        DEFAULT_ADMISSION, description="native engine: chunked: the next max_batch_prompts prompts start when all are "
        "done; continuous: a finished group's slot takes the next prompt at once. Same samples either way")
    partial_rollout_tokens: int | None = Field(
        None, ge=1, description="partial rollouts: a sample writes at most this many tokens per step; a group not "
        "done by then is kept and resumed in the next step (with that step's weights) until all its samples end. "
        "Tokens then span up to ceil(max_new_tokens / N) policy versions (multi-turn: max_total_tokens; metrics: "
        "staleness). Multi-turn episodes are cut within their turns, their environments saved. None: off")
    engine: str = Field("native", description="native: batched HF decoding, always there; vllm: vLLM (see "
                        "docs/engines.md); tidal/executors/generator/engines.py registers them")

    @model_validator(mode="after")
    def _engine_options(self) -> "GeneratorConfig":
        """Each extra section validated by the engine that declares it; the chosen engine's present (its defaults)."""
        from tidal.executors.generator.engines import ENGINES, options_sections  # the registry imports this module

        sections, extra = options_sections(self.engine), self.__pydantic_extra__
        own = ENGINES.get(self.engine)
        if own.options is not None:
            extra.setdefault(own.section, {})  # its defaults, validated below
        for key, value in extra.items():
            if key not in sections:
                close = closest(key, [*type(self).model_fields, *sections])
                raise ValueError(f"generator.{key}: unknown key" + (f"; did you mean generator.{close}?" if close else
                                 f" (the engines' option sections: {', '.join(sections) or 'none'})"))
            try:
                extra[key] = sections[key].model_validate(value)
            except ValidationError as e:  # named from the top, as a declared section's errors are
                raise ValueError(config_error(e, "", prefix=f"generator.{key}.", model=sections[key])
                                 .removeprefix("invalid config (): ")) from None
        return self

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the log-probs both sides compute: greedy samples score the raw logits."""
        return self.temperature if self.temperature > 0 else 1.0


class MultiTurnConfig(BaseModel):
    """Options of the multi-turn rollout (`rollout=multi_turn`): the model writes a turn, an environment
    answers, the model writes again (tidal/executors/generator/rollouts.py)."""

    model_config = ConfigDict(extra="forbid")
    env: str | None = Field(None, description="registered name (lookup, calculator, python) or module:Class; "
                            "None: lookup, the embedded task's (no data.path)")
    env_args: dict = Field(default_factory=dict, description="keyword arguments of the environment's constructor")
    max_turns: int = Field(3, ge=1, description="model turns per sample; the last one ends the episode (the "
                           "environment still steps it, told it is the last, for its reward parts; its observation "
                           "is not read)")
    max_total_tokens: int | None = Field(None, ge=2, description="a response's tokens, model turns and observations "
                                         "together; None: max_turns x (generator.max_new_tokens + 32)")
    timeout_s: float = Field(30.0, gt=0, description="each reset()/step() call of the environment")
    env_workers: int | None = Field(None, ge=0, description="environment calls in flight at once, each on a thread "
                                    "of its own (an `async def step` runs on one event loop instead) while the engine "
                                    "decodes the other samples (tidal/executors/environments/pool.py); None: as many as "
                                    "there are calls (sized for I/O-bound tools: a latency is hidden whole); N: at "
                                    "most N (a CPU-bound tool); 0: each call inline, the engine waiting")
    on_error: Literal["zero", "fail"] = Field(
        "zero", description="an environment that raises, hangs past timeout_s or answers with something that is "
        "not text or token ids: zero ends the sample with its turns so far and reward 0 (counted in "
        "generator/env_errors); fail stops the run")
    require_deterministic: bool = Field(False, description="refuse an environment whose class says deterministic = "
                                        "False (the sync == periodic equivalence holds only for deterministic ones)")

    def total_tokens(self, max_new_tokens: int) -> int:
        return self.max_total_tokens or self.max_turns * (max_new_tokens + 32)
