"""The generator executor: samples G responses per prompt and streams finished groups out."""
from __future__ import annotations

import time
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from channels.payloads import RolloutGroup, WeightsUpdate
from executors.base import Executor, ExecutorEnv, StepContext
from executors.embedded.task import embedded_prompts
from executors.generator.data import PromptRow, PromptSet, load_prompts
from executors.generator.engine import NativeEngine, PromptRequest, SamplingParams
from executors.hf import load_model, load_tokenizer


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
    prompts_per_step: int = Field(16, ge=1, description="B: prompt groups per optimizer step")
    max_prompt_tokens: int = Field(256, ge=1, description="longer prompts are dropped (counted), never cut")
    chat_template: bool = Field(False, description="apply the tokenizer's chat template to each prompt")
    embedded_prompts: int = Field(4096, ge=1, description="size of the generated embedded prompt set")


class GeneratorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: int = Field(1, ge=1, description="generator data-parallel replicas (one rank each)")
    samples_per_prompt: int = Field(8, ge=1, description="G: responses sampled per prompt")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(4, ge=1)
    max_batch_prompts: int = Field(16, ge=1, description="prompts decoded together in one inference chunk")
    engine: Literal["native"] = "native"


class Generator(Executor):
    inputs = {"weights": WeightsUpdate}
    outputs = {"rollouts": RolloutGroup}

    def __init__(self, *, name: str = "generator", config: GeneratorConfig, model: ModelConfig,
                 data: DataConfig, stream: bool):
        super().__init__(name=name, units=config.replicas)
        self.cfg, self.model_cfg, self.data_cfg, self.stream = config, model, data, stream

    def describe(self):
        return {"replicas": self.cfg.replicas, "G": self.cfg.samples_per_prompt,
                "engine": self.cfg.engine, "stream": self.stream}

    def init(self, env: ExecutorEnv) -> None:
        super().init(env)
        self.tokenizer = load_tokenizer(self.model_cfg.path)
        # same seed as the trainer's init, so step 0 samples with exactly the trainer's weights
        model = load_model(self.model_cfg.path, dtype=self.model_cfg.torch_dtype, seed=env.seed).to(env.device)
        self.engine = NativeEngine(model, eos_token_id=self.tokenizer.eos_token_id,
                                   pad_token_id=self.tokenizer.pad_token_id,
                                   max_batch_prompts=self.cfg.max_batch_prompts)
        rows = (load_prompts(self.data_cfg.path) if self.data_cfg.path else
                [PromptRow(prompt=r["prompt"], extras={"answer": r["answer"]})
                 for r in embedded_prompts(self.data_cfg.embedded_prompts, seed=env.seed)])
        self.prompts = PromptSet(rows, tokenizer=self.tokenizer, max_prompt_tokens=self.data_cfg.max_prompt_tokens,
                                 apply_chat_template=self.data_cfg.chat_template)
        if self.prompts.dropped and env.is_leader:
            print(f"tidal: {self.prompts.dropped} of {len(rows)} prompts are longer than "
                  f"max_prompt_tokens={self.data_cfg.max_prompt_tokens} and were dropped", flush=True)
        self.params = SamplingParams(n=self.cfg.samples_per_prompt, max_new_tokens=self.cfg.max_new_tokens,
                                     seed=env.seed, temperature=self.cfg.temperature, top_p=self.cfg.top_p)

    def step(self, ctx: StepContext):
        with ctx.timeline.span("weights_recv"):
            update = ctx.inbound["weights"].receive(self.engine.model.named_parameters())
            self.engine.update_weights(update)
        t0 = time.perf_counter()
        batch = self.prompts.batch(ctx.step, batch_size=self.data_cfg.prompts_per_step, seed=self.env.seed)
        mine = [(i, row, ids) for i, row, ids in batch if i % self.units == self.env.unit_index]
        rows = {i: row for i, row, _ in mine}
        requests = [PromptRequest(index=i, prompt_ids=ids) for i, _, ids in mine]
        out, tokens = ctx.outbound["rollouts"], 0
        held = []  # sync schedule: nothing leaves before the whole batch is generated
        start_t = time.time()
        with ctx.timeline.span("generate"):
            for done in self.engine.generate(requests, self.params, step=ctx.step):
                group = RolloutGroup(step=ctx.step, index=done.index, prompt=rows[done.index].prompt,
                                     extras=rows[done.index].extras, prompt_ids=done.prompt_ids_P,
                                     responses=done.response_ids, logprobs=done.logprobs,
                                     finished=done.finished_G)
                tokens += sum(r.numel() for r in done.response_ids)
                ctx.timeline.mark("generated", index=done.index)
                if self.stream:
                    out.send(group)
                else:
                    held.append(group)
        end_t = time.time()
        for group in sorted(held, key=lambda g: g.index):
            out.send(group)
        gen_s = time.perf_counter() - t0
        return {"gen_s": gen_s, "gen_tokens_per_s": tokens / max(gen_s, 1e-9), "gen_start_t": start_t,
                "gen_end_t": end_t}
