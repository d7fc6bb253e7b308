"""Schedules: when a consumer sees the items of a scheduled channel (DESIGN.md "The step, as a timeline").

    periodic: gen |=========|          every group is handed over the moment it arrives, so the
              trn   |=========|^       trainer starts at the first finished group
    sync:     gen |=========|          the whole step is collected first, then handed over in index
              trn           |=======|^ order: generation and training never overlap

A schedule wraps an executor's inbound stream; no executor knows which one runs. Both hand over the
same items, and the trainer's accumulation does not depend on their order (DESIGN.md
"Determinism"), so both give bit-identical weights. `^` is the barrier: the trainer's end of step
(optimizer step + weight push), which the generator waits for before the next step.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Protocol, TypeVar

T = TypeVar("T")


class Schedule(Protocol):
    name: str

    def __call__(self, items: Iterable[T]) -> Iterable[T]: ...


class Periodic:
    """Arrival order: each item as soon as it is in (periodic asynchrony within the step)."""

    name = "periodic"

    def __call__(self, items: Iterable[T]) -> Iterator[T]:
        yield from items


class Sync:
    """Collect the whole step, then hand the items over in index order."""

    name = "sync"

    def __call__(self, items: Iterable[T]) -> Iterator[T]:
        yield from sorted(items, key=lambda item: item.index)


SCHEDULES: dict[str, type] = {cls.name: cls for cls in (Periodic, Sync)}


def get_schedule(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]()
