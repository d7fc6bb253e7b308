"""What a trainer step accumulates besides gradients (barrier.Gradients), as typed values.

- `Pass`: the advantages a loss pass is evaluated at; each pass has its own gradient buffers.
- `LossSums`: the loss passes' sums and the batch denominator of one optimizer step.
- `GroupRecord`: what was sampled and scored, summed over the groups of a step.
Both are additive over micro-batches, groups and dp ranks, so a streamed step sums them as groups
arrive and all-reduces them once, at the barrier.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist

from channels.payloads import ScoredGroup
from executors.training.sums import Sums


class Pass(str, Enum):
    """The advantages a loss pass is evaluated at (algorithms/batch_scope.py): the scores, and for
    batch-scope algorithms also 1 and 0, combined exactly at the barrier."""

    SCORE = "score"
    ONE = "one"
    ZERO = "zero"


@dataclass
class LossSums:
    """Sums of one optimizer step's micro-batches (NOT divided by the batch denominator)."""

    loss: dict[Pass, float] = field(default_factory=lambda: dict.fromkeys(Pass, 0.0))
    denom: float = 0.0  # the algorithm's batch denominator (Algorithm.normaliser)
    kl_sum: float = 0.0
    clip_sum: float = 0.0
    entropy_sum: float = 0.0  # the policy's token entropy, summed over the response tokens trained on
    entropy_tokens: float = 0.0
    mismatch: float = 0.0  # max |trainer - sampler| log-prob of a sampled token: a max, not a sum
    ratio_sum: float = 0.0  # the policy / old-policy ratio summed over tokens (/ entropy_tokens: a mean)
    ratio_max: float = 0.0  # its largest token (sequence, for GSPO) value: a max

    def __iadd__(self, other: "LossSums") -> "LossSums":
        for name in Pass:
            self.loss[name] += other.loss[name]
        self.denom += other.denom
        self.kl_sum += other.kl_sum
        self.clip_sum += other.clip_sum
        self.entropy_sum += other.entropy_sum
        self.entropy_tokens += other.entropy_tokens
        self.mismatch = max(self.mismatch, other.mismatch)
        self.ratio_sum += other.ratio_sum
        self.ratio_max = max(self.ratio_max, other.ratio_max)
        return self

    def all_reduce(self, *, group: dist.ProcessGroup | None) -> "LossSums":
        if group is None or dist.get_world_size(group) == 1:
            return self
        sums = torch.tensor([*(self.loss[n] for n in Pass), self.denom, self.kl_sum, self.clip_sum,
                             self.entropy_sum, self.entropy_tokens, self.ratio_sum], dtype=torch.float64)
        maxima = torch.tensor([self.mismatch, self.ratio_max], dtype=torch.float64)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        *loss, denom, kl_sum, clip_sum, entropy_sum, entropy_tokens, ratio_sum = sums.tolist()
        mismatch, ratio_max = maxima.tolist()
        return LossSums(dict(zip(Pass, loss)), denom, kl_sum, clip_sum, entropy_sum, entropy_tokens, mismatch,
                        ratio_sum, ratio_max)


@dataclass
class GroupRecord(Sums):
    """What the groups of a step sampled and scored, and the tokens one pass trains on."""

    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    samples: float = 0.0
    len_sum: float = 0.0
    groups: float = 0.0
    reward_failures: float = 0.0
    tokens: float = 0.0

    @classmethod
    def of(cls, group: ScoredGroup, *, shared_prompt: bool) -> "GroupRecord":
        rewards = group.rewards.double()
        responses = float(sum(r.numel() for r in group.responses))
        # a shared prompt is trained once per group, else once per sample
        tokens = (1 if shared_prompt else len(group.responses)) * group.prompt_ids.numel() + responses
        return cls(rewards.sum().item(), (rewards ** 2).sum().item(), float(len(group.responses)), responses,
                   1.0, float(group.reward_failures), tokens)


