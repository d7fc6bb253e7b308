"""Schedules: when a consumer sees the items of a scheduled channel (docs/architecture.md "The step").

    periodic: gen |=========|          every group is handed over the moment it arrives, so the
              trn   |=========|^       trainer starts at the first finished group
    sync:     gen |=========|          the whole step is collected first, then handed over in index
              trn           |=======|^ order: generation and training never overlap

A schedule wraps an executor's inbound stream; no executor knows which one runs. Both hand over the
same items, and the trainer's accumulation does not depend on their order (docs/architecture.md
"Determinism"), so both give bit-identical weights. `^` is the barrier: the trainer's end of step
(optimizer step + weight push), which the generator waits for before the next step.

    offpolicy (max_lag=k):  the generator samples step s with the weights of barrier s-1-k, so it
              gen |====|====|====|     starts a step without waiting for the barrier before it and
              trn   |====|^===|^==|^   runs up to k steps ahead (LlamaRL's asynchronous mode). Every
    trained token is exactly min(s, k) policy versions old (metrics: staleness_mean/max); k = 0 is
    periodic. The lag is the WEIGHTS channel's (k + 1), so runs stay deterministic: an off-policy run
    is repeatable bit for bit, and its layouts give the same results like every other schedule's.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

T = TypeVar("T")


class Schedule(Protocol):
    name: str
    weights_lag: int  # the WEIGHTS channel's lag under this schedule

    def __call__(self, items: Iterable[T]) -> Iterable[T]: ...


class Periodic:
    """Arrival order: each item as soon as it is in (periodic asynchrony within the step)."""

    name = "periodic"
    weights_lag = 1  # the generator of step s+1 samples with the weights of step s's barrier

    def __call__(self, items: Iterable[T]) -> Iterator[T]:
        yield from items


class Sync:
    """Collect the whole step, then hand the items over in index order."""

    name = "sync"
    weights_lag = 1

    def __call__(self, items: Iterable[T]) -> Iterator[T]:
        yield from sorted(items, key=lambda item: item.index)


class OffPolicy(Periodic):
    """Periodic within a step, and the generator up to `max_lag` steps ahead of the trainer."""

    name = "offpolicy"

    def __init__(self, max_lag: int = 1):
        assert max_lag >= 0, max_lag  # the config refuses a negative one with its field's name
        self.max_lag = max_lag

    @property
    def weights_lag(self) -> int:
        return self.max_lag + 1


SCHEDULES: dict[str, type] = {cls.name: cls for cls in (Periodic, Sync, OffPolicy)}


def get_schedule(name: str, *, max_lag: int | None = None) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return OffPolicy(max_lag if max_lag is not None else 1) if name == "offpolicy" else SCHEDULES[name]()


class ScheduleConfig(BaseModel):
    """The run config's `schedule`: a name (`schedule: sync`), or a section with the off-policy bound."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["periodic", "sync", "offpolicy"] = Field(
        "periodic", description="periodic: train groups as they finish; sync: generate all, then train; "
                                "offpolicy: the generator runs up to max_lag steps ahead of the trainer")
    max_lag: int | None = Field(None, ge=0, description="offpolicy: how many policy versions behind the trained "
                                "weights a sample may be (None: 1; 0 is periodic)")

    @model_validator(mode="before")
    @classmethod
    def _named(cls, value):
        return {"kind": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> "ScheduleConfig":
        if self.max_lag is not None and self.kind != "offpolicy":
            raise ValueError(f"max_lag bounds the offpolicy schedule's staleness; schedule {self.kind!r} is "
                             f"on-policy (set schedule.kind=offpolicy or drop schedule.max_lag)")
        return self

    def build(self) -> Schedule:
        return get_schedule(self.kind, max_lag=self.max_lag)

    @property
    def weights_lag(self) -> int:
        return self.build().weights_lag

    def __str__(self) -> str:
        return self.kind if self.kind != "offpolicy" else f"offpolicy (max_lag={self.build().max_lag})"
