"""What a trainer step accumulates besides gradients (barrier.Gradients), as typed values.

- `Pass` (tidal/algorithms/objective.py): the advantages a loss pass is evaluated at; each pass has its own
  gradient buffers.
- `LossSums`: the loss passes' sums, the batch denominator and the loss's statistics of one optimizer step.
- `Mismatch`: the trainer's log-prob of each sampled token minus the sampler's (the on-policy check).
- `GroupRecord`: what was sampled and scored, summed over the groups of a step.
Both are additive over micro-batches, groups and dp ranks, so a streamed step sums them as groups
arrive and all-reduces them once, at the barrier.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from tidal.algorithms import figures
from tidal.algorithms.base import LossOutput
from tidal.algorithms.figures import Figure
from tidal.algorithms.objective import Pass
from tidal.channels.payloads import ScoredGroup
from tidal.executors.learner.sums import Sums


@dataclass
class Mismatch:
    """trainer - sampler log-prob of every sampled token of a step's first pass, kept as values (B*G*T
    floats) rather than sums: a quantile needs them all. Exact under streaming and over dp: each dp
    rank keeps its groups' values and `all_gather` hands every rank the step's full set at the
    barrier; `summary` sorts them first, so arrival order cannot change a bit of any figure."""

    diffs: list[torch.Tensor] = field(default_factory=list)  # float64, CPU, one per micro-batch
    # the same tokens' staleness 0 flags: sampled by the weights that score them (offpolicy and partial
    # rollouts train older tokens too, whose difference is staleness, not numerics)
    fresh: list[torch.Tensor] = field(default_factory=list)

    def add(self, *, logp_NT: torch.Tensor, sampled_NT: torch.Tensor, mask_NT: torch.Tensor,
            fresh_NT: torch.Tensor | None = None) -> None:
        mask_NT = mask_NT.bool()
        self.diffs.append((logp_NT.detach()[mask_NT].double() - sampled_NT[mask_NT].double()).cpu())
        self.fresh.append(torch.ones(self.diffs[-1].shape, dtype=torch.bool) if fresh_NT is None
                          else fresh_NT.to(mask_NT.device)[mask_NT].cpu())

    def __iadd__(self, other: "Mismatch") -> "Mismatch":
        self.diffs, self.fresh = self.diffs + other.diffs, self.fresh + other.fresh
        return self

    def values(self) -> torch.Tensor:
        return torch.cat(self.diffs) if self.diffs else torch.zeros(0, dtype=torch.float64)

    def all_gather(self, *, group: dist.ProcessGroup | None) -> "Mismatch":
        """Every dp rank's values on every rank, in rank order."""
        d_K = self.values()
        f_K = torch.cat(self.fresh) if self.fresh else torch.zeros(0, dtype=torch.bool)
        if group is None or dist.get_world_size(group) == 1:
            return Mismatch([d_K], [f_K])
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (d_K, f_K), group=group)  # sizes differ by rank: objects, not tensors
        return Mismatch([d for d, _ in gathered], [f for _, f in gathered])

    def summary(self) -> dict[str, float]:
        """logp_mismatch_{max, mean, p99} of |trainer - sampler| over the tokens, and logp_mismatch_kl:
        KL(sampler || trainer) per token, k3 estimator exp(d) - 1 - d with d = trainer - sampler (the
        tokens were drawn from the sampler; k3 is >= 0 and unbiased); 0 for a step with no tokens.
        logp_mismatch_fresh_max: the largest over the tokens of staleness 0 alone (what numerics decide:
        exactly 0 under model.numerics=exact, whatever the schedule)."""
        values = self.values()
        fresh = values[torch.cat(self.fresh)] if self.fresh else values
        fresh_max = fresh.abs().max().item() if fresh.numel() else 0.0
        d_K = values.sort().values  # sorted: the sums below are independent of arrival order
        if d_K.numel() == 0:
            return {"logp_mismatch_max": 0.0, "logp_mismatch_mean": 0.0, "logp_mismatch_p99": 0.0,
                    "logp_mismatch_kl": 0.0, "logp_mismatch_fresh_max": 0.0}
        abs_K = d_K.abs().sort().values
        k3_K = (torch.expm1(d_K) - d_K).sort().values
        return {"logp_mismatch_max": abs_K[-1].item(), "logp_mismatch_mean": abs_K.mean().item(),
                "logp_mismatch_p99": torch.quantile(abs_K, 0.99).item(), "logp_mismatch_kl": k3_K.mean().item(),
                "logp_mismatch_fresh_max": fresh_max}


@dataclass
class LossSums:
    """Sums of one optimizer step's micro-batches (NOT divided by the batch denominator): the loss passes',
    the trainer's own figures, and the loss's statistics by name (tidal/algorithms/figures.py), which
    nothing here lists: adding micro-batches, the all-reduce over dp and the report take whatever names
    the loss gave."""

    loss: dict[Pass, float] = field(default_factory=lambda: dict.fromkeys(Pass, 0.0))
    denom: float = 0.0  # the algorithm's batch denominator (Algorithm.normaliser)
    entropy_sum: float = 0.0  # the policy's token entropy, summed over the response tokens trained on
    entropy_tokens: float = 0.0
    routed_tokens: float = 0.0  # MoE: tokens trained with the generator's recorded routing at hand
    routing_differs: float = 0.0  # of them, those whose trainer top-k differed in some layer (tidal/modeling/moe.py)
    figures: dict[str, Figure] = field(default_factory=dict)  # the score pass's statistics, LossOutput.stats
    mismatch: Mismatch = field(default_factory=Mismatch)  # values, not a sum: gathered over dp

    def add_loss(self, name: Pass, out: LossOutput) -> None:
        """A loss pass of one micro-batch; the score pass's statistics too."""
        self.loss[name] += out.loss_sum.item()
        if name is Pass.SCORE:
            self.denom += out.denom
            self.figures = figures.add(self.figures, out.stats)

    def _own(self) -> list[str]:
        return [f.name for f in fields(self) if f.name not in ("loss", "figures", "mismatch")]

    def __iadd__(self, other: "LossSums") -> "LossSums":
        for name in Pass:
            self.loss[name] += other.loss[name]
        for name in self._own():
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.figures = figures.add(self.figures, other.figures)
        self.mismatch += other.mismatch
        return self

    def all_reduce(self, *, group: dist.ProcessGroup | None) -> "LossSums":
        if group is None or dist.get_world_size(group) == 1:
            return self
        # a rank that trained no micro-batch has no figures: the names are agreed first, a missing one is a zero
        names = [None] * dist.get_world_size(group)
        dist.all_gather_object(names, {name: type(fig) for name, fig in self.figures.items()}, group=group)
        kinds = dict(sorted({name: kind for theirs in names for name, kind in theirs.items()}.items()))
        figure_sums, figure_maxima = figures.flatten(self.figures, kinds)
        own = [self.loss[name] for name in Pass] + [getattr(self, name) for name in self._own()]
        sums = torch.tensor(own + figure_sums, dtype=torch.float64)
        maxima = torch.tensor(figure_maxima, dtype=torch.float64)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        values = sums.tolist()
        return LossSums(loss=dict(zip(Pass, values)), **dict(zip(self._own(), values[len(Pass):len(own)])),
                        figures=figures.unflatten(kinds, values[len(own):], maxima.tolist()),
                        mismatch=self.mismatch.all_gather(group=group))


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


