"""The order a trainer rank takes its groups in (executors/learner/order.py)."""
from __future__ import annotations

from types import SimpleNamespace

from executors.learner.order import in_index_order


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
