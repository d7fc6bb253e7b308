"""The trainer's barrier: reduce over dp, normalise once by the batch denominator, clip, step.

Batch-level denominators (1/(B·G), DAPO's 1/total-tokens) are applied here, once, to the
accumulated gradient: gradients are linear in the loss, so dividing the sum at the end equals
dividing each term (DESIGN.md "Normalisation that survives streaming"). Where the objective
evaluates a first step at several passes (batch-scope advantages), it says how they combine
(algorithms/objective.py `combine`), and they are combined here.
The optimizer itself (AdamW, schedule, accumulators, clipping, checkpoint) is modeling/optim.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Callable

from executors.trainer.accumulate import LossSums, Mismatch, Pass
from modeling.optim import Optimizer


@dataclass(frozen=True)
class OptimizerStep:
    """What one optimizer step reports."""

    loss: float  # summed over the batch (batch scope: combined at the batch's mean and scale)
    denom: float
    kl_sum: float
    clip_sum: float
    entropy_sum: float
    entropy_tokens: float
    grad_norm: float  # before clipping
    mismatch: Mismatch  # every dp rank's values (gathered)
    lr: float
    ratio_sum: float = 0.0
    ratio_max: float = 0.0
    is_weight_sum: float = 0.0
    dropped_tokens: float = 0.0
    routed_tokens: float = 0.0
    routing_differs: float = 0.0


class Barrier(Optimizer):
    """The policy's optimizer, stepping on the combination of its loss passes."""

    def step(self, sums: LossSums, *, passes: tuple[Pass, ...], combine: Callable | None = None) -> OptimizerStep:
        """One optimizer step from the accumulated `passes`; `combine` ({pass: value} -> value, for
        gradients and loss sums alike): how the objective combines them, None: the score pass alone."""
        sums = sums.all_reduce(group=self.dp_group)
        self.reduce_(passes)
        by_pass, loss = self.grads.by_pass, sums.loss[Pass.SCORE]
        grads = by_pass[Pass.SCORE]
        if combine is not None:
            grads = [combine(dict(zip(by_pass, per_param))) for per_param in zip(*by_pass.values())]
            loss = combine({name: sums.loss[name] for name in by_pass})
        grad_norm, lr = self.apply(grads, denom=sums.denom)
        return OptimizerStep(loss, sums.denom, sums.kl_sum, sums.clip_sum, sums.entropy_sum, sums.entropy_tokens,
                             grad_norm, sums.mismatch, lr, sums.ratio_sum, sums.ratio_max, sums.is_weight_sum,
                             sums.dropped_tokens, sums.routed_tokens, sums.routing_differs)
