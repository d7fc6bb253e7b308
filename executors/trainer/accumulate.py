"""What a trainer step accumulates besides gradients (barrier.Gradients), as typed values.

- `Pass` (algorithms/objective.py): the advantages a loss pass is evaluated at; each pass has its own
  gradient buffers.
- `LossSums`: the loss passes' sums and the batch denominator of one optimizer step.
- `Mismatch`: the trainer's log-prob of each sampled token minus the sampler's (the on-policy check).
- `GroupRecord`: what was sampled and scored, summed over the groups of a step.
Both are additive over micro-batches, groups and dp ranks, so a streamed step sums them as groups
arrive and all-reduces them once, at the barrier.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from algorithms.objective import Pass
from channels.payloads import ScoredGroup
from executors.learner.sums import Sums


@dataclass
class Mismatch:
    """trainer - sampler log-prob of every sampled token of a step's first pass, kept as values (B*G*T
    floats) rather than sums: a quantile needs them all. Exact under streaming and over dp: each dp
    rank keeps its groups' values and `all_gather` hands every rank the step's full set at the
    barrier; `summary` sorts them first, so arrival order cannot change a bit of any figure."""

    diffs: list[torch.Tensor] = field(default_factory=list)  # float64, CPU, one per micro-batch

    def add(self, *, logp_NT: torch.Tensor, sampled_NT: torch.Tensor, mask_NT: torch.Tensor) -> None:
        mask_NT = mask_NT.bool()
        self.diffs.append((logp_NT.detach()[mask_NT].double() - sampled_NT[mask_NT].double()).cpu())

    def __iadd__(self, other: "Mismatch") -> "Mismatch":
        self.diffs = self.diffs + other.diffs
        return self

    def values(self) -> torch.Tensor:
        return torch.cat(self.diffs) if self.diffs else torch.zeros(0, dtype=torch.float64)

    def all_gather(self, *, group: dist.ProcessGroup | None) -> "Mismatch":
        """Every dp rank's values on every rank, in rank order."""
        d_K = self.values()
        if group is None or dist.get_world_size(group) == 1:
            return Mismatch([d_K])
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, d_K, group=group)  # sizes differ by rank: objects, not tensors
        return Mismatch(gathered)

    def summary(self) -> dict[str, float]:
        """logp_mismatch_{max, mean, p99} of |trainer - sampler| over the tokens, and logp_mismatch_kl:
        KL(sampler || trainer) per token, k3 estimator exp(d) - 1 - d with d = trainer - sampler (the
        tokens were drawn from the sampler; k3 is >= 0 and unbiased); 0 for a step with no tokens."""
        d_K = self.values().sort().values  # sorted: the sums below are independent of arrival order
        if d_K.numel() == 0:
            return {"logp_mismatch_max": 0.0, "logp_mismatch_mean": 0.0, "logp_mismatch_p99": 0.0,
                    "logp_mismatch_kl": 0.0}
        abs_K = d_K.abs().sort().values
        k3_K = (torch.expm1(d_K) - d_K).sort().values
        return {"logp_mismatch_max": abs_K[-1].item(), "logp_mismatch_mean": abs_K.mean().item(),
                "logp_mismatch_p99": torch.quantile(abs_K, 0.99).item(), "logp_mismatch_kl": k3_K.mean().item()}


@dataclass
class LossSums:
    """Sums of one optimizer step's micro-batches (NOT divided by the batch denominator)."""

    loss: dict[Pass, float] = field(default_factory=lambda: dict.fromkeys(Pass, 0.0))
    denom: float = 0.0  # the algorithm's batch denominator (Algorithm.normaliser)
    kl_sum: float = 0.0
    clip_sum: float = 0.0
    entropy_sum: float = 0.0  # the policy's token entropy, summed over the response tokens trained on
    entropy_tokens: float = 0.0
    mismatch: Mismatch = field(default_factory=Mismatch)  # values, not a sum: gathered over dp
    ratio_sum: float = 0.0  # the policy / old-policy ratio summed over tokens (/ entropy_tokens: a mean)
    ratio_max: float = 0.0  # its largest token (sequence, for GSPO) value: a max
    is_weight_sum: float = 0.0  # a correction's weights over the tokens kept (algorithms/corrections.py)
    dropped_tokens: float = 0.0  # tokens a correction dropped
    routed_tokens: float = 0.0  # MoE: tokens trained with the generator's recorded routing at hand
    routing_differs: float = 0.0  # of them, those whose trainer top-k differed in some layer (modeling/moe.py)

    def __iadd__(self, other: "LossSums") -> "LossSums":
        for name in Pass:
            self.loss[name] += other.loss[name]
        self.denom += other.denom
        self.kl_sum += other.kl_sum
        self.clip_sum += other.clip_sum
        self.entropy_sum += other.entropy_sum
        self.entropy_tokens += other.entropy_tokens
        self.mismatch += other.mismatch
        self.ratio_sum += other.ratio_sum
        self.ratio_max = max(self.ratio_max, other.ratio_max)
        self.is_weight_sum += other.is_weight_sum
        self.dropped_tokens += other.dropped_tokens
        self.routed_tokens += other.routed_tokens
        self.routing_differs += other.routing_differs
        return self

    def all_reduce(self, *, group: dist.ProcessGroup | None) -> "LossSums":
        if group is None or dist.get_world_size(group) == 1:
            return self
        sums = torch.tensor([*(self.loss[n] for n in Pass), self.denom, self.kl_sum, self.clip_sum,
                             self.entropy_sum, self.entropy_tokens, self.ratio_sum, self.is_weight_sum,
                             self.dropped_tokens, self.routed_tokens, self.routing_differs], dtype=torch.float64)
        maxima = torch.tensor([self.ratio_max], dtype=torch.float64)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        *loss, denom, kl_sum, clip_sum, entropy_sum, entropy_tokens, ratio_sum, is_weight_sum, dropped, routed, \
            differs = sums.tolist()
        (ratio_max,) = maxima.tolist()
        mismatch = self.mismatch.all_gather(group=group)
        return LossSums(dict(zip(Pass, loss)), denom, kl_sum, clip_sum, entropy_sum, entropy_tokens, mismatch,
                        ratio_sum, ratio_max, is_weight_sum, dropped, routed, differs)


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


