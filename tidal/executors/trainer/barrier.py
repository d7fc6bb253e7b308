"""The trainer's barrier: reduce over the backend's groups, normalise once by the batch denominator, clip, step.

Batch-level denominators (1/(B·G), DAPO's 1/total-tokens) are applied here, once, to the
accumulated gradient: gradients are linear in the loss, so dividing the sum at the end equals
dividing each term (docs/architecture.md "Determinism"). Where the objective
evaluates a first step at several passes (batch-scope advantages), it says how they combine
(tidal/algorithms/objective.py `combine`), and they are combined here.
The optimizer itself (AdamW, schedule, accumulators, clipping, checkpoint) is tidal/modeling/optim.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Callable

from tidal.executors.trainer.accumulate import LossSums, Pass
from tidal.modeling.optim import Optimizer


@dataclass(frozen=True)
class OptimizerStep:
    """What one optimizer step reports: its sums over dp (LossSums), the loss as the objective combines
    its passes, the gradient norm before clipping and the lr stepped with; under fp16 the loss scale its
    backward ran with, and whether an overflow skipped it."""

    sums: LossSums
    loss: float  # summed over the batch (batch scope: combined at the batch's mean and scale)
    grad_norm: float
    lr: float
    loss_scale: float | None = None
    skipped: bool = False


class Barrier(Optimizer):
    """The policy's optimizer, stepping on the combination of its loss passes."""

    def __init__(self, model, *, sums_over: tuple, **kwargs):
        """sums_over: the groups the loss sums are added over, in order (TrainerModels.sums_over)."""
        super().__init__(model, **kwargs)
        self.sums_over = sums_over

    def step(self, sums: LossSums, *, passes: tuple[Pass, ...], combine: Callable | None = None) -> OptimizerStep:
        """One optimizer step from the accumulated `passes`; `combine` ({pass: value} -> value, for
        gradients and loss sums alike): how the objective combines them, None: the score pass alone."""
        for group in self.sums_over:
            sums = sums.all_reduce(group=group)
        self.reduce_(passes)
        by_pass, loss = self.grads.by_pass, sums.loss[Pass.SCORE]
        grads = by_pass[Pass.SCORE]
        if combine is not None:
            grads = [combine(dict(zip(by_pass, per_param))) for per_param in zip(*by_pass.values())]
            loss = combine({name: sums.loss[name] for name in by_pass})
        scale, skipped = (self.scaler.scale, self.scaler.skipped) if self.scaler is not None else (None, 0)
        grad_norm, lr = self.apply(grads, denom=sums.denom)
        return OptimizerStep(sums, loss, grad_norm, lr, loss_scale=scale,
                             skipped=self.scaler is not None and self.scaler.skipped > skipped)
