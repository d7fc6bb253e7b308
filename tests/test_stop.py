"""A stop abandons the step in flight (tidal/common/stop.py): the ranks of a unit agree on when, and an
abandoned receive is continued, not restarted."""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tidal.common.stop import ABORT
from tidal.executors.base import ExecutorEnv, unit_aborted
from tidal.common.spawn import spawn


def _agree(rank_with_abort: int) -> list[bool]:
    """Two ranks of one unit ask 3 times; the flag is set on one rank only before the 2nd question."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    env = ExecutorEnv(name="generator", ranks=(0, 1), units=((0, 1),), rank=rank, group=None,
                      device=torch.device("cpu"), seed=0, output_dir=Path("."), unit_group=dist.new_group([0, 1]))
    answers = []
    for i in range(3):
        if i == 1 and rank == rank_with_abort:
            ABORT.set()
        answers.append(unit_aborted(env))
    dist.destroy_process_group()
    return answers


def test_a_units_ranks_stop_at_the_same_point():
    """Decoding in lockstep, a unit's ranks must leave at the same iteration though only one of them
    has seen the stop yet: otherwise the other waits forever in the next forward's collective."""
    for who in (0, 1):
        assert spawn(_agree, 2, who, timeout_s=120) == [[False, True, True]] * 2


def test_a_rank_alone_needs_no_agreement():
    env = ExecutorEnv(name="reward", ranks=(0,), units=((0,),), rank=0, group=None, device=torch.device("cpu"),
                      seed=0, output_dir=Path("."))
    ABORT.clear()
    assert unit_aborted(env) is False
    ABORT.set()
    try:
        assert unit_aborted(env) is True
    finally:
        ABORT.clear()
