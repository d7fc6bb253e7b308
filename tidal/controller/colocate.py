"""placement=colocated: every executor on the generator's ranks, time-sharing their devices.

The first placed executor keeps its ranks; every other becomes its guest, in its own layout over the
same ranks (the trainer's dp x tp, the critic's), and each evaluation guest follows its own host. On
each rank a step then runs its phases one after the other: generate, release the engine's memory
(`offload`), score, train with the optimizer state brought back (`onload`), the barrier, the push
into this rank's engine (a local copy: tidal/channels/p2p.py) and the optimizer state out again.

Only the sync schedule fits: periodic trains while generation goes on, and on one device the two
would only take turns, each waiting for memory the other holds.
"""
from __future__ import annotations

from tidal.executors.base import Executor


def colocate(executors: list[Executor]) -> list[Executor]:
    """The executors on the first one's ranks, in the order a rank runs them: each executor placed
    before, followed by its guests (an evaluation right after the phase it belongs to)."""
    placed = [ex for ex in executors if ex.host is None]
    root = placed[0]
    for ex in placed[1:]:
        if ex.ranks != root.ranks:
            raise ValueError(f"placement=colocated: {ex.name} runs on {ex.ranks} rank(s) ({ex.units} x "
                             f"{ex.ranks_per_unit}) but {root.name} on {root.ranks}; co-located executors share every rank")
        ex.host = root
    return [e for ex in placed for e in (ex, *[g for g in executors if g.host is ex and g not in placed])]
