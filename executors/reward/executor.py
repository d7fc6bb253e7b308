"""The reward executor: scores each rollout group as it arrives and forwards it to the trainer."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from channels.payloads import GroupVerdict, RolloutGroup, ScoredGroup
from executors.base import Executor, ExecutorEnv, StepContext
from executors.reward.config import RewardConfig
from executors.reward.functions import resolve_reward, score_group


@dataclass(frozen=True)
class RewardMetrics:
    """The reward executor's per-step record in metrics.jsonl (failures are counted by the trainer)."""

    score_s: float  # busy scoring


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
        from executors.hf import load_tokenizer  # transformers: on the reward's ranks only

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
                                                 on_error=self.cfg.on_error, timeout_s=self.cfg.timeout_s)
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
        return RewardMetrics(score_s=busy)
