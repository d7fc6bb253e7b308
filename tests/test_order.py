"""The order a trainer rank takes its groups in (tidal/executors/learner/order.py)."""
from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import torch

from tidal.executors.learner.order import IndexOrderedSum, in_index_order
from tidal.modeling.optim import Gradients, InPlaceGradients


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


def _backward(param, g: torch.Tensor) -> None:
    """What autograd does with a backward's gradient: the first is .grad, later ones add in place."""
    if param.grad is None:
        param.grad = g.clone()
    else:
        param.grad += g


def _train(arrivals, *, spares: int, micro_batches: int = 2, first: int = 0, stride: int = 1, passes=PASSES):
    """The learner's streamed loop over groups arriving in `arrivals`: the accumulators, the order
    groups were taken in, and the most groups ever held. One pass: the parameter's .grad is the sum
    (InPlaceGradients, as the trainer makes it for one float32 pass)."""
    param = torch.nn.Parameter(torch.zeros(64))
    grads = (Gradients([param], passes=passes, dtype=torch.float32) if len(passes) > 1 else
             InPlaceGradients([param], name=passes[0]))
    ordered = IndexOrderedSum(grads, spares=spares)
    ordered.start(first=first, stride=stride)
    taken, most_held = [], 0
    for group in ordered.intake(_groups(*arrivals)):
        taken.append(group.index)
        ordered.open(group.index)
        for mb in range(micro_batches):
            for name in passes:
                _backward(param, _grad(group.index, mb, name))
                ordered.add(name)
        ordered.close()
        most_held = max(most_held, len(ordered.held))
    ordered.settle()
    assert not ordered.held
    return {n: grads.by_pass[n][0].clone() for n in passes}, taken, most_held


def _in_index_order(indices, *, micro_batches: int = 2, passes=PASSES):
    """The reference: each micro-batch's gradient added straight in, groups in index order."""
    sums = {n: torch.zeros(64) for n in passes}
    for i in sorted(indices):
        for mb in range(micro_batches):
            for n in passes:
                sums[n] += _grad(i, mb, n)
    return sums


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_float32_sums_are_the_same_bits_in_every_arrival_order_and_spare_count():
    """Two loss passes in accumulators, and one pass summed in the parameter's own .grad."""
    for passes in (PASSES, PASSES[:1]):
        reference = _in_index_order(range(5), passes=passes)
        for arrivals in itertools.permutations(range(5)):
            for spares in (0, 1, 2, 5):
                sums, taken, most_held = _train(arrivals, spares=spares, passes=passes)
                assert _equal(sums, reference), (arrivals, spares, passes)
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
            for passes in (PASSES, PASSES[:1]):
                sums, _, _ = _train(arrivals, spares=spares, micro_batches=1, first=1, stride=2, passes=passes)
                assert _equal(sums, {n: reference[n] for n in passes}), (arrivals, spares, passes)
