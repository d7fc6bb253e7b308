"""What an executor that trains a model on prompt groups (the trainer, the critic) does alike: its
layout's units, the order it takes its groups in, and the units of work they become."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

from tidal.executors.base import Executor
from tidal.executors.learner.config import LearnerConfig
from tidal.executors.learner.order import IndexOrderedSum, Work, in_index_order, work_units


class Learner(Executor):
    """A dp x tp layout of one model (and its copies), training each group as it is handed over.

    Subclasses set `self.models` in `init`: an object with `micro_batches(group)` and `dp_group`
    (tidal/executors/learner/models.py LearnerModels).
    """

    def __init__(self, *, name: str, config: LearnerConfig):
        super().__init__(name=name, units=config.dp, ranks_per_unit=config.ranks_per_unit)
        self.stages = config.stages  # pipeline stages per unit (the trainer's megatron backend)
        self.context_ranks = config.cp  # context-parallel ranks per unit (the trainer's torch backend)
        self.cfg = config
        # FSDP over several dp units: they hold shards of one copy and train in lockstep rounds (order.py)
        self.shards_over_units = config.shards_over_units
        self.lockstep = config.lockstep
        self.expert_shards = config.ep
        self.ordered = config.index_ordered
        self.passes = config.epochs * config.mini_batches  # optimizer steps per batch
        self._sum: IndexOrderedSum | None = None  # set by _order_sums once the optimizer exists

    def _order_sums(self) -> None:
        """After `self.optim` is made: float32 accumulators under free arrival add in index order
        (order.py IndexOrderedSum); index-ordered layouts and float64 accumulators add as they come."""
        if not self.ordered and not self.cfg.fp64_grad_accumulation:
            self._sum = IndexOrderedSum(self.optim.grads, spares=self.cfg.grad_spares)

    def _in_order(self, groups: Iterable) -> Iterable:
        """Arrival order, or index order where this rank's peers must take the same groups (order.py),
        or arrival order within the spares of the index-ordered float32 sum."""
        if self.ordered:
            return in_index_order(groups, first=self.env.unit_index, stride=self.units)
        if self._sum is not None:
            self._sum.start(first=self.env.unit_index, stride=self.units)
            return self._sum.intake(groups)
        return groups

    @contextmanager
    def _summing(self, group) -> Iterator[None]:
        """While one streamed group trains: its gradients go in at its index's turn."""
        if self._sum is None or group is None:
            yield
            return
        self._sum.open(group.index)
        yield
        self._sum.close()

    def _accumulate(self, name) -> None:
        """A loss pass's gradients, off the parameters, into the accumulators of pass `name`."""
        if self._sum is not None and self._sum.is_open:
            self._sum.add(name)
        else:
            self.optim.grads.add_from_params_(name)

    def _settle(self) -> None:
        """At the barrier, before the reduction: the groups still held, in index order."""
        if self._sum is not None:
            self._sum.settle()

    def _work(self, groups: Iterable) -> Iterator[Work]:
        return work_units(groups, micro_batches=self.models.micro_batches, mini_batch_of=self._mini_batch,
                          mini_batches=self.cfg.mini_batches,
                          lockstep=self.models.dp_group if self.lockstep else None)

    # ---- time-sharing the device (placement=colocated) ---------------------------------------------
    def onload(self, ctx) -> None:
        """Before training: the optimizer state back on the device (the `onload` span)."""
        if self.env.time_shared:
            with ctx.timeline.span("onload"):
                self.optim.move_state_(self.env.device)

    def offload(self, ctx) -> None:
        """After the barrier's push: the optimizer state to host memory while the engine generates
        (the `offload` span); the weights stay, the trainer's forwards need them first."""
        if self.env.time_shared:
            with ctx.timeline.span("offload"):
                self.optim.move_state_(torch.device("cpu"))

    def _mini_batch(self, index: int) -> int:
        # groups i and i + dp land on different dp ranks; stepping over dp keeps mini-batches balanced
        return (index // self.units) % self.cfg.mini_batches
