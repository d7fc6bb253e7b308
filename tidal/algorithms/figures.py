"""A loss's statistics, each named once, where the loss computes it.

A loss returns `{metric name: figure}` for its micro-batch (LossOutput.stats). The trainer adds the
figures of a name over the step's micro-batches and dp ranks, by their kind, and reports each under
its name (`trainer/<name>`): a new statistic is one line in its loss, and nothing else names it.

- `Mean(total, over)`: reported as the step's sum of `total` over its sum of `over`. Both parts are
  sums, so the mean is exact whatever the micro-batches, their order or the dp layout: a mean of the
  micro-batches' means would weigh a short micro-batch like a long one.
- `Largest(value)`: reported as the largest over the step.

Torch-free: a figure is plain floats (`.item()`ed by the loss).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mean:
    total: float  # e.g. the KL summed in the normaliser's units
    over: float  # e.g. the micro-batch's share of the batch denominator, or its token count

    def __add__(self, other: "Mean") -> "Mean":
        return Mean(self.total + other.total, self.over + other.over)

    def value(self) -> float:
        return self.total / self.over if self.over else 0.0  # 0: a step with nothing to average


@dataclass(frozen=True)
class Largest:
    largest: float

    def __add__(self, other: "Largest") -> "Largest":
        return Largest(max(self.largest, other.largest))

    def value(self) -> float:
        return self.largest


Figure = Mean | Largest


def zero(kind: type) -> Figure:
    """What a figure of `kind` is before any micro-batch: 0 + x, as a field that started at 0.0 would give."""
    return Largest(0.0) if kind is Largest else Mean(0.0, 0.0)


def add(figures: dict[str, Figure], more: dict[str, Figure]) -> dict[str, Figure]:
    """`figures` with `more` added name by name (a name new to `figures` starts at its kind's zero)."""
    out = dict(figures)
    for name, fig in more.items():
        out[name] = out.get(name, zero(type(fig))) + fig
    return out


def flatten(figures: dict[str, Figure], kinds: dict[str, type]) -> tuple[list[float], list[float]]:
    """The figures of `kinds` (a name `figures` lacks is its kind's zero) as the floats a sum and a max over ranks
    take: every Mean's total and over, then every Largest's value, in `kinds`' order (the same on every rank)."""
    full = add({name: zero(kind) for name, kind in kinds.items()}, figures)
    sums = [x for name, kind in kinds.items() if kind is Mean for x in (full[name].total, full[name].over)]
    return sums, [full[name].largest for name, kind in kinds.items() if kind is Largest]


def unflatten(kinds: dict[str, type], sums: list[float], maxima: list[float]) -> dict[str, Figure]:
    """`flatten`'s inverse, once the floats are summed and maxed."""
    means, largest = iter(sums), iter(maxima)
    return {name: Mean(next(means), next(means)) if kind is Mean else Largest(next(largest))
            for name, kind in kinds.items()}
