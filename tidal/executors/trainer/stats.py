"""What a trainer step carries from its streamed phase to its barrier, and what it reports."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, fields

import torch

from tidal.channels.payloads import ScoredGroup
from tidal.executors.trainer.accumulate import GroupRecord, LossSums


@dataclass
class StepState:
    """One step's values, passed from `Trainer.step` to `Trainer.barrier`; none outlives the step."""

    record: GroupRecord = field(default_factory=GroupRecord)
    sums: LossSums = field(default_factory=LossSums)  # mini-batch 0, trained as the groups arrived
    digests: dict[int, str] = field(default_factory=dict)  # group index -> digest of its tokens
    errors: dict[int, str] = field(default_factory=dict)  # group index -> its first failed reward's message
    # group index -> advantages (batch scope: the scores, normalised at the barrier); computed once
    # per group and step, since they may need reference forwards (a KL in the reward)
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    moments: dict[int, torch.Tensor] = field(default_factory=dict)  # batch scope: score moments per group
    # group index -> (staleness summed over its model tokens, their number, the largest): RolloutGroup.staleness
    versions: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    held: list[ScoredGroup] = field(default_factory=list)  # for later mini-batches and epochs
    logged: list[ScoredGroup] = field(default_factory=list)  # for samples.jsonl, on a logging step
    train_s: float = 0.0
    first_train_t: float | None = None  # wall clock of the first group trained
    step: int = 0  # the step trained: a token sampled by its weights has staleness 0


@dataclass(frozen=True)
class TrainerMetrics:
    """The trainer's per-step record in metrics.jsonl (posted by its leader)."""

    reward_mean: float
    reward_std: float
    response_len_mean: float
    loss: float
    # the loss's statistics by name, e.g. kl, clip_frac, ratio_mean, is_weight_mean (the loss's own lines:
    # tidal/algorithms/token_loss.py); posted as trainer/<name> beside the fields (`as_metrics`)
    stats: dict[str, float] = field(default_factory=dict, kw_only=True)
    # how many policy versions behind the trained weights the step's tokens were sampled (RolloutGroup
    # .policy_version): the mean over the model's tokens, and the largest; 0 in on-policy schedules
    staleness_mean: float
    staleness_max: int
    entropy: float  # the policy's mean token entropy (at the sampling temperature) over the tokens trained on
    grad_norm: float  # mean over the step's optimizer steps, before clipping
    lr: float
    # trainer.precision=fp16: the loss scale of the step's last optimizer step, and how many of its optimizer
    # steps an overflow skipped (tidal/modeling/loss_scale.py); None and 0 in fp32 and bf16
    loss_scale: float | None
    skipped_steps: int
    # on-policy check, |trainer - sampler| log-prob of the sampled tokens (accumulate.Mismatch): the
    # largest, the mean, the exact 99th percentile over the step's tokens, and the per-token KL(sampler || trainer)
    logp_mismatch_max: float
    logp_mismatch_mean: float
    logp_mismatch_p99: float
    logp_mismatch_kl: float
    logp_mismatch_fresh_max: float  # the largest over the tokens of staleness 0 (the same as max on-policy)
    # MoE with the generator's routing recorded: the fraction of the tokens trained whose trainer top-k
    # differed from it in some routed layer (replayed or not: trainer.routing_replay); None for a dense model
    routing_mismatch_frac: float | None
    groups: int
    samples: int
    reward_failures: int  # samples whose reward failed and was scored 0 (reward.on_error=zero)
    reward_first_error: str | None  # the message of the first (lowest prompt index) of them
    tokens: int
    optimizer_steps: int
    train_s: float
    push_s: float
    # pipeline stages (trainer.pp > 1): of the stages' time in the pipeline's work, the share spent waiting
    # on a neighbour stage (tidal/modeling/megatron/pipeline.py); None with one stage
    pipeline_bubble: float | None = field(default=None, kw_only=True)
    push_bytes: int  # what the weight push carries from the trainer's ranks (all parameters, or LoRA's adapters)
    rollout_digest: str  # hash of every sampled token, in prompt/sample order
    first_train_t: float | None
    push_end_t: float

    def as_metrics(self) -> dict:
        """The fields, the loss's statistics in place of `stats`, each under its own name."""
        row = {}
        for f in fields(self):
            row |= self.stats if f.name == "stats" else {f.name: getattr(self, f.name)}
        assert len(row) == len(fields(self)) - 1 + len(self.stats), f"a loss statistic shadows a field: {self.stats}"
        return row

    @classmethod
    def of(cls, record: GroupRecord, steps: list, digests: dict[int, str], *, errors: dict[int, str],
           staleness: tuple[float, int], **timing) -> "TrainerMetrics":
        """From the step's dp-reduced record and its optimizer steps (barrier.OptimizerStep); `errors`:
        the first reward error of each group that had one, over all dp ranks; `staleness`: (mean, max)."""
        if not steps:  # no group ended in the step (partial rollouts): each figure as its type has nothing
            return cls(**{f.name: _nothing(f.type) for f in fields(cls) if f.name not in timing}, **timing)
        total = LossSums()  # the step's optimizer steps together (mini-batches and epochs each have one)
        for s in steps:
            total += s.sums
        n, tokens = record.samples, total.entropy_tokens
        mean = record.reward_sum / n
        digest = hashlib.sha256("".join(digests[i] for i in sorted(digests)).encode()).hexdigest()[:16]
        return cls(reward_mean=mean, reward_std=math.sqrt(max(0.0, record.reward_sq_sum / n - mean * mean)),
                   response_len_mean=record.len_sum / n, loss=sum(s.loss for s in steps) / total.denom,
                   stats={name: fig.value() for name, fig in total.figures.items()},
                   staleness_mean=staleness[0], staleness_max=staleness[1],
                   entropy=total.entropy_sum / max(1.0, tokens),
                   grad_norm=sum(s.grad_norm / len(steps) for s in steps), lr=steps[-1].lr,
                   loss_scale=steps[-1].loss_scale, skipped_steps=sum(s.skipped for s in steps),
                   **total.mismatch.summary(),  # only a batch's first pass has values
                   routing_mismatch_frac=total.routing_differs / total.routed_tokens if total.routed_tokens else None,
                   groups=int(record.groups), samples=int(record.samples), reward_failures=int(record.reward_failures),
                   reward_first_error=errors[min(errors)] if errors else None, tokens=int(record.tokens),
                   optimizer_steps=len(steps), rollout_digest=digest, **timing)


def _nothing(annotation: str):
    """A figure of a step that trained nothing, by its type: NaN, 0, None where it may be, no statistics."""
    if annotation.endswith(" | None"):
        return None
    return {"float": math.nan, "int": 0, "dict[str, float]": {}, "str": hashlib.sha256(b"").hexdigest()[:16]}[annotation]


def group_digest(group: ScoredGroup) -> str:
    h = hashlib.sha256(f"{group.index}:{group.prompt_ids.tolist()}".encode())
    for r in group.responses:
        h.update(r.to(torch.int64).numpy().tobytes() + b"|")
    for m in group.loss_masks or ():  # multi-turn: who wrote each token is part of what was sampled
        h.update(m.to(torch.uint8).numpy().tobytes() + b"|")
    return h.hexdigest()
