"""Small real executors for runtime tests: they move ragged tensors through real channels."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from executors.base import Executor, StepContext


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


class Producer(Executor):
    """Unit u produces the items with index % units == u; `delays[u]` seconds before each item."""

    outputs = {"items": Item}

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
            ctx.outbound["items"].send(make_item(ctx.step, i, origin=unit))
        return {"produced": len(range(unit, self.items_per_step, self.units))}


class Relay(Executor):
    """Receives items and (optionally) forwards them unchanged; records what arrived and when."""

    inputs = {"items": Item}
    outputs = {"back": Item}

    def __init__(self, *, name="relay", units=1, forward=True, fail_at_step=None):
        super().__init__(name=name, units=units)
        self.forward, self.fail_at_step = forward, fail_at_step
        self.received: list[tuple[int, Item, float]] = []
        if not forward:
            self.outputs = {}

    def step(self, ctx: StepContext):
        if ctx.step == self.fail_at_step:
            raise RuntimeError(f"{self.name} fails on purpose at step {ctx.step}")
        n = 0
        for item in ctx.inbound["items"]:
            self.received.append((ctx.step, item, time.monotonic()))
            n += 1
            if self.forward:
                ctx.outbound["back"].send(item)
        return {"received": n}


class Sink(Executor):
    inputs = {"back": Item}

    def __init__(self, *, name="sink", units=1):
        super().__init__(name=name, units=units)
        self.received: list[tuple[int, Item]] = []

    def step(self, ctx: StepContext):
        for item in ctx.inbound["back"]:
            self.received.append((ctx.step, item))
        return {"received": len(self.received)}
