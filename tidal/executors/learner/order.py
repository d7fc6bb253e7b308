"""In which order a trainer rank takes its groups, and how its dp ranks keep in step.

- free (tp = 1, no FSDP): arrival order. dp replicas share nothing until the barrier, so each
  trains a group the moment it lands.
- ordered (tp > 1): a unit's tp ranks run a collective in every forward, so they must take the
  same groups in the same order. Arrival order can differ between them when several reward units
  send, so they take index order instead: each group as soon as it and every earlier group of the
  unit is in.
- lockstep (FSDP over dp > 1): every forward and backward is a collective over dp too, so the dp
  ranks go in rounds. Round k is each rank's k-th group in index order: group d + k*dp on rank d,
  so all of a round is in mini-batch k % mini_batches. A round runs as many micro-steps as its
  longest group needs; a rank with fewer runs zero-weight dummies (the reduce-scatter still carries
  the others' gradients to it), and a rank with no group left runs only dummies until no rank has
  one. Pairing by round, never by arrival, keeps the result bit-identical across schedules.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Generic, Iterable, Iterator, TypeVar

import torch
import torch.distributed as dist

G = TypeVar("G")


def in_index_order(groups: Iterable[G], *, first: int, stride: int) -> Iterator[G]:
    """Yield groups with index first, first + stride, ... as soon as each is in; when the stream
    ends, whatever is left (indices with gaps, e.g. after dynamic sampling) in index order."""
    waiting, expected = {}, first
    for group in groups:
        waiting[group.index] = group
        while expected in waiting:
            yield waiting.pop(expected)
            expected += stride
    yield from (waiting[i] for i in sorted(waiting))


def round_length(micro_batches: int, *, group: dist.ProcessGroup) -> int:
    """Micro-steps of this lockstep round: the most any dp rank needs (0: every rank is done)."""
    n = torch.tensor([micro_batches], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    return int(n.item())


@dataclass(frozen=True)
class Work(Generic[G]):
    """One unit of a rank's training work: a group's micro-batches, or a lockstep round's share."""

    mini_batch: int
    group: G | None  # None: a lockstep round in which this rank has no group left
    micro_batches: list
    steps: int  # micro-steps to run: len(micro_batches), or the round's longest in lockstep


def work_units(groups: Iterable[G], *, micro_batches: Callable[[G], list], mini_batch_of: Callable[[int], int],
               mini_batches: int, lockstep: dist.ProcessGroup | None) -> Iterator[Work[G]]:
    """One Work per group; in lockstep one per round, the micro-steps padded to the round's longest
    group and the group None where this rank has none left, until no rank has one."""
    groups = iter(groups)
    for k in itertools.count():
        group = next(groups, None)
        if group is None and lockstep is None:
            return
        mbs = micro_batches(group) if group is not None else []
        steps = round_length(len(mbs), group=lockstep) if lockstep is not None else len(mbs)
        if steps == 0:
            return
        # in lockstep round k holds groups k*dp .. k*dp + dp - 1, all of one mini-batch
        yield Work(mini_batch_of(group.index) if group is not None else k % mini_batches, group, mbs, steps)


class IndexOrderedSum:
    """Float32 gradient sums that do not depend on the order the groups arrive in.

    A float32 sum depends on its order, and under free arrival (tp = 1, no FSDP) a rank trains each
    group as it lands: sync and periodic, or two runs of one schedule, see different orders. So the
    micro-batch gradients go into the accumulators in one fixed order, (group index, micro-batch,
    loss pass), whatever the arrival order:
    - the group whose turn it is (the rank's next index: first, first + stride, ...) adds straight in;
    - a group that lands early may train ahead into spare buffers (each micro-batch's gradients,
      held as they came off the parameters, no copy), up to `spares` groups; they are added once
      their predecessors are in;
    - with every spare taken, a further early group waits untrained for its turn (`intake`).
    When the stream ends with indices missing (dynamic sampling dropped a group, partial rollouts
    cut one), the rest go in index order: held groups first where their index comes first.

    Memory: one gradient-sized float32 buffer per held micro-batch and loss pass, for at most
    `spares` groups, instead of float64 accumulators' 8 bytes a parameter per pass always. The
    float64 option (trainer.fp64_grad_accumulation) adds in arrival order and never holds."""

    def __init__(self, grads, *, spares: int):
        self.grads, self.spares = grads, spares
        self.start(first=0, stride=1)

    def start(self, *, first: int, stride: int) -> None:
        """A new step: this rank's groups are first, first + stride, ..."""
        self.next, self.stride, self.draining = first, stride, False
        self.held: dict[int, list[tuple]] = {}  # index -> [(pass, gradients)] in the order they came
        self._open: int | None = None  # the group being trained; held unless its turn
        self._aside: list = []  # the sums set aside while a held group trains (Gradients.set_aside)

    def intake(self, groups: Iterable[G]) -> Iterator[G]:
        """Groups as they arrive, except that an early one with no spare left waits for its turn; each
        is trained (open/close) before the next is asked for."""
        waiting: dict[int, G] = {}
        for group in groups:
            waiting[group.index] = group
            while waiting:
                index = self.next if self.next in waiting else min(waiting)
                if index != self.next and len(self.held) >= self.spares:
                    break
                yield waiting.pop(index)
        self.draining = True  # the stream ended: whatever is left goes in index order
        for index in sorted(waiting):
            yield waiting[index]

    def open(self, index: int) -> None:
        assert self._open is None, ("a group is open", self._open)
        if self.draining:
            for earlier in sorted(i for i in self.held if i < index):
                self._add_held(earlier)
            self.next = index
        self._open = index
        if index != self.next:
            self.held[index] = []
            self._aside = self.grads.set_aside()  # its backwards start from no gradient

    @property
    def is_open(self) -> bool:
        return self._open is not None

    def add(self, name) -> None:
        """One loss pass's gradients of a micro-batch of the open group, off the parameters."""
        if self._open in self.held:
            self.held[self._open].append((name, self.grads.take_from_params()))
        else:
            self.grads.add_from_params_(name)

    def close(self) -> None:
        index, self._open = self._open, None
        if index in self.held:
            self.grads.put_back(self._aside)
            self._aside = []
        if index == self.next and not self.draining:
            self.next += self.stride
            while self.next in self.held:  # early groups whose predecessors are now in
                self._add_held(self.next)
                self.next += self.stride

    def settle(self) -> None:
        """Before the step's reduction: every held group, in index order."""
        assert self._open is None, ("a group is open at the barrier", self._open)
        for index in sorted(self.held):
            self._add_held(index)

    def _add_held(self, index: int) -> None:
        for name, grads in self.held.pop(index):
            self.grads.add_(name, grads)
