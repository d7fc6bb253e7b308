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
