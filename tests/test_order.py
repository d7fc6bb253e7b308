"""The order a trainer rank takes its groups in (executors/learner/order.py)."""
from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import torch

from executors.learner.order import IndexOrderedSum, in_index_order
from modeling.optim import Gradients


def _groups(*indices):
    return [SimpleNamespace(index=i) for i in indices]


def _order(arrivals, *, first, stride):
    return [g.index for g in in_index_order(_groups(*arrivals), first=first, stride=stride)]


def test_index_order_whatever_the_arrival_order():
    assert _order([4, 0, 2, 6], first=0, stride=2) == [0, 2, 4, 6]
    assert _order([5, 3, 1], first=1, stride=2) == [1, 3, 5]


def test_each_group_leaves_as_soon_as_every_earlier_one_is_in():
    taken, arrived = [], []

    def stream():
        for g in _groups(2, 0, 6, 4):
            arrived.append(g.index)
            yield g

    for g in in_index_order(stream(), first=0, stride=2):
        taken.append((g.index, len(arrived)))
    # 0 leaves on the 2nd arrival (with 2 right behind it), 4 on the 4th (then 6)
    assert taken == [(0, 2), (2, 2), (4, 4), (6, 4)]


def test_gaps_are_taken_in_index_order_at_the_end():
    # dynamic sampling keeps only some indices: nothing waits for a group that never comes
    assert _order([9, 3, 7], first=1, stride=2) == [3, 7, 9]


# ---- IndexOrderedSum: float32 sums in index order whatever the arrival order -------------------

PASSES = ("a", "b")


def _grad(index: int, mb: int, name: str) -> torch.Tensor:
    """A micro-batch's gradient, fixed by (group, micro-batch, pass); magnitudes spread over 2^-8..2^8
    so that float32 sums in another order differ in the last bits."""
    g = torch.Generator().manual_seed(1000 * index + 10 * mb + PASSES.index(name))
    return torch.randn(64, generator=g) * torch.exp2(torch.randint(-8, 9, (64,), generator=g).float())


def _train(arrivals, *, spares: int, micro_batches: int = 2, first: int = 0, stride: int = 1):
    """The learner's streamed loop over groups arriving in `arrivals`: the accumulators, the order
    groups were taken in, and the most groups ever held."""
    param = torch.nn.Parameter(torch.zeros(64))
    grads = Gradients([param], passes=PASSES, dtype=torch.float32)
    ordered = IndexOrderedSum(grads, spares=spares)
    ordered.start(first=first, stride=stride)
    taken, most_held = [], 0
    for group in ordered.intake(_groups(*arrivals)):
        taken.append(group.index)
        ordered.open(group.index)
        for mb in range(micro_batches):
            for name in PASSES:
                param.grad = _grad(group.index, mb, name).clone()
                ordered.add(name, grads.take_from_params())
        ordered.close()
        most_held = max(most_held, len(ordered.held))
    ordered.settle()
    assert not ordered.held
    return {n: grads.by_pass[n][0].clone() for n in PASSES}, taken, most_held


def _in_index_order(indices, *, micro_batches: int = 2):
    """The reference: each micro-batch's gradient added straight in, groups in index order."""
    sums = {n: torch.zeros(64) for n in PASSES}
    for i in sorted(indices):
        for mb in range(micro_batches):
            for n in PASSES:
                sums[n] += _grad(i, mb, n)
    return sums


def _equal(a, b) -> bool:
    return all(torch.equal(a[n], b[n]) for n in PASSES)


def test_float32_sums_are_the_same_bits_in_every_arrival_order_and_spare_count():
    reference = _in_index_order(range(5))
    for arrivals in itertools.permutations(range(5)):
        for spares in (0, 1, 2, 5):
            sums, taken, most_held = _train(arrivals, spares=spares)
            assert _equal(sums, reference), (arrivals, spares)
            assert sorted(taken) == list(range(5)) and most_held <= spares
    # the test can fail: arrival order, summed as it comes, gives other bits
    arrival = {n: torch.zeros(64) for n in PASSES}
    for i in (3, 0, 4, 1, 2):
        for mb in range(2):
            for n in PASSES:
                arrival[n] += _grad(i, mb, n)
    assert not _equal(arrival, reference)


def test_a_group_with_no_spare_left_waits_for_its_turn_and_early_ones_train_ahead():
    _, taken, _ = _train([3, 2, 1, 0], spares=0)
    assert taken == [0, 1, 2, 3]  # nothing ahead: index order, each once its predecessors are in
    _, taken, most_held = _train([3, 2, 1, 0], spares=2)
    assert taken == [3, 2, 0, 1] and most_held == 2  # 3 and 2 ahead; 1 waited for 0


def test_gaps_and_strides_sum_in_index_order():
    """A dp rank's groups (first 1, stride 2) with 5 dropped (dynamic sampling) and 11 carried in
    (partial rollouts): held groups past the gap go in index order when the stream ends."""
    indices = [1, 3, 7, 9, 11]
    reference = _in_index_order(indices, micro_batches=1)
    rng = random.Random(0)
    for _ in range(40):
        arrivals = rng.sample(indices, len(indices))
        for spares in (0, 1, 3):
            sums, _, _ = _train(arrivals, spares=spares, micro_batches=1, first=1, stride=2)
            assert _equal(sums, reference), (arrivals, spares)
