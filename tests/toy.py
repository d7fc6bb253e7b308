"""Small real executors for runtime tests: they move ragged tensors through real channels."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tidal.executors.base import Executor, Input, Output, StepContext


@dataclass
class Item:
    index: int
    origin: int  # producing unit
    tag: str
    dense_2x3: torch.Tensor
    ragged: list[torch.Tensor]


def make_item(step: int, index: int, origin: int = 0) -> Item:
    g = torch.Generator().manual_seed(step * 1000 + index)
    lengths = torch.randint(0, 7, (3,), generator=g).tolist()  # includes empty pieces
    return Item(index=index, origin=origin, tag=f"s{step}i{index}",
                dense_2x3=torch.randn(2, 3, generator=g, dtype=torch.float64),
                ragged=[torch.randint(0, 1000, (n,), generator=g) for n in lengths])


@dataclass(frozen=True)
class Count:
    """A toy executor's metrics record: items it made or received."""

    items: int


class Producer(Executor):
    """Unit u produces the items with index % units == u; `delays[u]` seconds before each item."""

    items = Output(Item)

    def __init__(self, *, name="producer", units=1, items_per_step=6, delays=(), fail_at_step=None):
        super().__init__(name=name, units=units)
        self.items_per_step, self.delays, self.fail_at_step = items_per_step, delays, fail_at_step

    def step(self, ctx: StepContext):
        if ctx.step == self.fail_at_step:
            raise RuntimeError(f"{self.name} fails on purpose at step {ctx.step}")
        unit = self.env.unit_index
        for i in range(unit, self.items_per_step, self.units):
            if self.delays:
                time.sleep(self.delays[unit])
            ctx.outbound[self.items].send(make_item(ctx.step, i, origin=unit))
        return Count(len(range(unit, self.items_per_step, self.units)))


class Relay(Executor):
    """Receives items and (optionally) forwards them unchanged; records what arrived and when."""

    items = Input(Item)
    back = Output(Item, optional=True)

    def __init__(self, *, name="relay", units=1, forward=True, fail_at_step=None):
        super().__init__(name=name, units=units)
        self.forward, self.fail_at_step = forward, fail_at_step
        self.received: list[tuple[int, Item, float]] = []

    def needs(self, port) -> bool:
        return port is Relay.back and self.forward or super().needs(port)

    def step(self, ctx: StepContext):
        if ctx.step == self.fail_at_step:
            raise RuntimeError(f"{self.name} fails on purpose at step {ctx.step}")
        n = 0
        for item in ctx.inbound[self.items]:
            self.received.append((ctx.step, item, time.monotonic()))
            n += 1
            if self.forward:
                ctx.outbound[self.back].send(item)
        return Count(n)


class Sink(Executor):
    back = Input(Item)

    def __init__(self, *, name="sink", units=1):
        super().__init__(name=name, units=units)
        self.received: list[tuple[int, Item]] = []

    def step(self, ctx: StepContext):
        for item in ctx.inbound[self.back]:
            self.received.append((ctx.step, item))
        return Count(len(self.received))
