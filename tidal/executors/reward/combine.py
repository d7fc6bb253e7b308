"""Combine two scorings of the same rollout groups into one reward: a weighted sum per prompt index.

Both inbound channels carry the same groups (the generator's rollouts fan out to two scorers), each
in its own arrival order. A group leaves as soon as both of its scores are in.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from tidal.channels.payloads import ScoredGroup
from tidal.executors.base import Executor, Input, Output, StepContext
from tidal.executors.reward.config import CombineConfig


def pair_by_index(primary: Iterable[ScoredGroup], secondary: Iterable[ScoredGroup]
                  ) -> Iterator[tuple[ScoredGroup, ScoredGroup]]:
    """Yield (a, b) with a.index == b.index, in the arrival order of `primary`.

    For each item of `primary`, items of `secondary` are read (and buffered) until its match is in;
    both streams end at the end of the step, so a missing match is an error, not a wait.
    """
    buffered: dict[int, ScoredGroup] = {}
    rest = iter(secondary)
    for a in primary:
        while a.index not in buffered:
            b = next(rest, None)
            if b is None:
                raise ValueError(f"combine: prompt {a.index} was scored on one input only")
            if b.index in buffered:
                raise ValueError(f"combine: prompt {b.index} arrived twice on one input")
            buffered[b.index] = b
        yield a, buffered.pop(a.index)
    unmatched = sorted([*buffered, *(b.index for b in rest)])
    if unmatched:
        raise ValueError(f"combine: prompts {unmatched} were scored on one input only")


def combine(rule: ScoredGroup, model: ScoredGroup, *, rule_weight: float, model_weight: float) -> ScoredGroup:
    """The rule group with rewards rule_weight * rule + model_weight * model (same bits in any arrival order)."""
    if (rule.step, rule.index, len(rule.responses)) != (model.step, model.index, len(model.responses)):
        raise ValueError(f"combine: scores of different groups (step {rule.step} prompt {rule.index} with "
                         f"{len(rule.responses)} responses vs step {model.step} prompt {model.index} with "
                         f"{len(model.responses)})")
    # float64 then one rounding: the sum is a fixed expression of the two scores, whoever came first
    rewards_G = (rule_weight * rule.rewards.double() + model_weight * model.rewards.double()).float()
    return dataclasses.replace(rule, rewards=rewards_G, reward_failures=rule.reward_failures + model.reward_failures,
                               reward_parts={**rule.reward_parts, **model.reward_parts},
                               first_error=rule.first_error or model.first_error)


@dataclass(frozen=True)
class CombineMetrics:
    combine_busy_s: float
    rule_reward_mean: float  # over the whole batch (all replicas)
    model_reward_mean: float


class CombineRewards(Executor):
    rule = Input(ScoredGroup)
    model = Input(ScoredGroup)
    scored = Output(ScoredGroup)
    needs_device = False  # sums scores on the CPU

    def __init__(self, *, name: str = "combine", config: CombineConfig):
        super().__init__(name=name, units=config.replicas)
        self.cfg = config

    def describe(self):
        return {"replicas": self.cfg.replicas, "weights": f"rule={self.cfg.rule_weight}, "
                                                          f"model={self.cfg.model_weight}"}

    def step(self, ctx: StepContext):
        busy = 0.0
        sums = torch.zeros(3, dtype=torch.float64)  # rule reward sum, model reward sum, samples
        # the model stream is the slower one in practice: waiting on it and picking the (already
        # buffered) rule score emits each group right when its second score lands
        for model, rule in pair_by_index(ctx.inbound[self.model], ctx.inbound[self.rule]):
            t0 = time.perf_counter()
            with ctx.timeline.span("combined", index=rule.index):
                scored = combine(rule, model, rule_weight=self.cfg.rule_weight, model_weight=self.cfg.model_weight)
            ctx.outbound[self.scored].send(scored)
            busy += time.perf_counter() - t0
            sums += torch.tensor([rule.rewards.double().sum(), model.rewards.double().sum(), rule.rewards.numel()])
        if self.units > 1:  # each replica saw a share of the groups; the leader reports the batch
            sums = sums.to(self.env.device)
            dist.all_reduce(sums, group=self.env.group)
            sums = sums.cpu()
        n = max(sums[2].item(), 1.0)
        return CombineMetrics(combine_busy_s=busy, rule_reward_mean=sums[0].item() / n,
                              model_reward_mean=sums[1].item() / n)
