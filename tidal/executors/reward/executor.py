"""The reward executor: scores each rollout group as it arrives and forwards it to the trainer."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from tidal.channels.payloads import GroupVerdict, RolloutGroup, ScoredGroup
from tidal.executors.base import Executor, ExecutorEnv, Input, Output, StepContext
from tidal.executors.reward.config import RewardConfig
from tidal.executors.reward.functions import RewardError, resolve_reward, score_group


@dataclass(frozen=True)
class RewardMetrics:
    """The reward executor's per-step record in metrics.jsonl (failures are counted by the trainer)."""

    score_s: float  # busy scoring


class Reward(Executor):
    rollouts = Input(RolloutGroup)
    scored = Output(ScoredGroup)
    verdicts = Output(GroupVerdict, optional=True)  # dynamic sampling: kept or dropped, back to the generator
    needs_device = False  # rule functions run on the CPU

    def __init__(self, *, name: str = "reward", config: RewardConfig, functions: list[str],
                 tokenizer_path: str | None, keep: Callable[[torch.Tensor], bool] | None = None):
        """`keep`: dynamic sampling's group filter; dropped groups never reach the trainer and each
        group's verdict goes back to the generator, which tops the batch up."""
        super().__init__(name=name, units=config.replicas)
        self.cfg, self.specs, self.tokenizer_path, self.keep = config, functions, tokenizer_path, keep
        self.fns = [resolve_reward(spec) for spec in functions]  # fail at build time, before any rank blocks
        self.failed_steps = 0  # steps in a row whose every reward failed (on_error="zero")

    def needs(self, port) -> bool:
        return port is Reward.verdicts and self.keep is not None or super().needs(port)

    def describe(self):
        return {"replicas": self.cfg.replicas, "functions": ",".join(self.specs)}

    def init(self, env: ExecutorEnv) -> None:
        super().init(env)
        from tidal.modeling.hf import load_tokenizer  # transformers: on the reward's ranks only

        self.tokenizer = load_tokenizer(self.tokenizer_path)
        self.weights = self.cfg.weights or [1.0] * len(self.fns)

    def score(self, group: RolloutGroup) -> tuple[list[str], torch.Tensor, dict[str, list[float]], dict[int, str]]:
        """(texts, the weighted reward [G], each function's scores, {failed sample: its first error}) of
        one group. A sample counts as failed once, however many of its functions failed: its reward is off."""
        samples = group.extras if group.episodes is None else self._episodes(group)
        # a multi-turn sample's answer is its last turn (the transcript is in sample["turns"])
        texts = (self.tokenizer.batch_decode(group.responses, skip_special_tokens=True) if group.episodes is None
                 else [next(t["text"] for t in reversed(s["turns"]) if t["role"] == "assistant") for s in samples])
        total_G = torch.zeros(len(texts), dtype=torch.float32)
        errors, parts = {}, {}
        for spec, fn, w in zip(self.specs, self.fns, self.weights):
            scores, failed = score_group(fn, name=spec, prompt=group.prompt, responses=texts, sample=samples,
                                         prompt_index=group.index, data_row=group.data_row,
                                         on_error=self.cfg.on_error, timeout_s=self.cfg.timeout_s)
            total_G += w * torch.tensor(scores, dtype=torch.float32)
            for sample_index, message in failed.items():
                errors.setdefault(sample_index, message)
            parts[spec] = scores
        if group.episodes is not None:  # an episode its environment failed in scores 0 (multi_turn.on_error=zero)
            total_G.masked_fill_(torch.tensor([e["error"] is not None for e in group.episodes]), 0.0)
        return texts, total_G, parts, errors

    def _episodes(self, group: RolloutGroup) -> list[dict]:
        """A multi-turn group's samples as rewards read them: the data row, `turns` (role and text of
        each turn: assistant, tool) and `env` (the environment's reward parts)."""
        out = []
        for i, episode in enumerate(group.episodes):
            turns = [{"role": role, "text": self.tokenizer.decode(ids, skip_special_tokens=True)}
                     for role, ids in group.turns(i)]
            out.append({**group.extras, "turns": turns, "env": episode["reward_parts"]})
        return out

    def step(self, ctx: StepContext):
        busy, failures, samples, first = 0.0, 0, 0, None
        for group in ctx.inbound[self.rollouts]:
            t0 = time.perf_counter()
            with ctx.timeline.span("scored", index=group.index):
                _, total_G, parts, errors = self.score(group)
                first_error = errors[min(errors)] if errors else None
                scored = ScoredGroup(**vars(group), rewards=total_G, reward_failures=len(errors),
                                     reward_parts=parts, first_error=first_error)
            failures, samples = failures + len(errors), samples + total_G.numel()
            if errors and (first is None or group.index < first[0]):  # by index: the same in any arrival order
                first = (group.index, first_error)
            kept = self.keep is None or self.keep(total_G)
            if kept:
                ctx.outbound[self.scored].send(scored)
            if self.keep is not None:
                ctx.outbound[self.verdicts].send(GroupVerdict(index=group.index, kept=kept))
            busy += time.perf_counter() - t0
        self._stop_if_all_failed(failures=failures, samples=samples, first_error=first[1] if first else None)
        return RewardMetrics(score_s=busy)

    def _stop_if_all_failed(self, *, failures: int, samples: int, first_error: str | None) -> None:
        """on_error=zero carries a run over failing rewards, but one whose rewards all fail, step after
        step, trains on zeros: stop it, naming the error. Each replica counts its own groups, with no
        collective: a step that a stop request cuts short on one replica cannot leave another waiting.
        When every reward fails, every replica sees it at the same step."""
        if self.cfg.on_error != "zero" or not self.cfg.max_failed_steps:
            return
        self.failed_steps = self.failed_steps + 1 if samples and failures == samples else 0
        if self.failed_steps >= self.cfg.max_failed_steps:
            first = f"; the first error: {first_error}" if first_error else ""
            steps = f"{self.failed_steps} step" + ("s" if self.failed_steps > 1 else "")
            raise RewardError(f"every reward failed in {steps} in a row (scored 0 by "
                              f"reward.on_error=zero){first}; fix the reward, or set reward.max_failed_steps=0 "
                              f"to train on")
