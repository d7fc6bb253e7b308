"""Records that are sums: additive over micro-batches, groups and data-parallel ranks, so a streamed
step adds them up as groups arrive and all-reduces them once, at the barrier."""
from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch
import torch.distributed as dist


S = TypeVar("S", bound="Sums")


class Sums:
    """Mixin for a dataclass whose fields are all floats that add up."""

    def __iadd__(self: S, other: S) -> S:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def all_reduce(self: S, *, group: dist.ProcessGroup | None) -> S:
        """The sum over `group`'s ranks (every rank calls it); self on one rank."""
        if group is None or dist.get_world_size(group) == 1:
            return self
        packed = torch.tensor(dataclasses.astuple(self), dtype=torch.float64)
        dist.all_reduce(packed, group=group)
        return type(self)(*packed.tolist())
