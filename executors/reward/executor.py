"""The reward executor: scores each rollout group as it arrives and forwards it to the trainer."""
from __future__ import annotations

import time
from typing import Callable, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from channels.payloads import GroupVerdict, RolloutGroup, ScoredGroup
from executors.base import Executor, ExecutorEnv, StepContext
from executors.hf import load_tokenizer
from executors.reward.functions import resolve_reward, score_group


class RewardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: int = Field(1, ge=1, description="reward replicas (one rank each)")
    functions: list[str] | None = Field(
        None, description="registered names or module:function; default: `embedded` for the embedded "
                          "task, `math_verify` for a data file")
    weights: list[float] | None = Field(None, description="one weight per function (default all 1)")
    on_error: Literal["fail", "zero"] = Field("fail", description="a reward that raises or returns NaN: "
                                              "stop the run, or score 0 and count it")

    @model_validator(mode="after")
    def _weights_match(self):
        if self.weights is not None and (self.functions is None or len(self.weights) != len(self.functions)):
            raise ValueError("reward.weights needs one weight per entry of reward.functions")
        return self


class Reward(Executor):
    inputs = {"rollouts": RolloutGroup}
    outputs = {"scored": ScoredGroup}

    def __init__(self, *, name: str = "reward", config: RewardConfig, functions: list[str],
                 tokenizer_path: str | None, keep: Callable[[torch.Tensor], bool] | None = None):
        """`keep`: dynamic sampling's group filter; dropped groups never reach the trainer and each
        group's verdict goes back to the generator, which tops the batch up."""
        super().__init__(name=name, units=config.replicas)
        self.cfg, self.specs, self.tokenizer_path, self.keep = config, functions, tokenizer_path, keep
        if keep is not None:
            self.outputs = {**self.outputs, "verdicts": GroupVerdict}
        self.fns = [resolve_reward(spec) for spec in functions]  # fail at build time, before any rank blocks

    def describe(self):
        return {"replicas": self.cfg.replicas, "functions": ",".join(self.specs)}

    def init(self, env: ExecutorEnv) -> None:
        super().init(env)
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        self.weights = self.cfg.weights or [1.0] * len(self.fns)

    def step(self, ctx: StepContext):
        busy, failures, groups = 0.0, 0, 0
        for group in ctx.inbound["rollouts"]:
            t0 = time.perf_counter()
            with ctx.timeline.span("scored", index=group.index):
                texts = self.tokenizer.batch_decode(group.responses, skip_special_tokens=True)
                total_G = torch.zeros(len(texts), dtype=torch.float32)
                group_failures = 0
                for spec, fn, w in zip(self.specs, self.fns, self.weights):
                    scores, failed = score_group(fn, name=spec, prompt=group.prompt, responses=texts,
                                                 sample=group.extras, prompt_index=group.index,
                                                 on_error=self.cfg.on_error)
                    total_G += w * torch.tensor(scores, dtype=torch.float32)
                    group_failures += failed
                scored = ScoredGroup(**vars(group), rewards=total_G, reward_failures=group_failures)
            failures += group_failures
            if self.keep is None:
                ctx.outbound["scored"].send(scored)
            else:
                kept = self.keep(total_G)
                if kept:
                    ctx.outbound["scored"].send(scored)
                ctx.outbound["verdicts"].send(GroupVerdict(index=group.index, kept=kept))
            busy += time.perf_counter() - t0
            groups += 1
        return {"score_s": busy}  # failures are counted batch-wide by the trainer
