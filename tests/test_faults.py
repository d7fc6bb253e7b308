"""Faults under torchrun name their cause: a rank killed by a signal is named with its executor on
every rank's line, and a hung reward is named (reward, prompt, sample) within its timeout."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e import launch, rank_pid, start, wait_for_steps


@pytest.mark.parametrize("rank, executor", [(0, "generator"), (1, "reward"), (2, "trainer")])
def test_killed_rank_is_named_by_every_rank(tmp_path, rank, executor):
    proc = start(tmp_path, steps=500)
    wait_for_steps(tmp_path, 2, proc)
    t0 = time.monotonic()
    os.kill(rank_pid(proc.pid, rank), signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    # (a line may follow the progress bar's last, unterminated one)
    lines = ["tidal:" + line.split("tidal:", 1)[1] for line in err.splitlines() if "tidal:" in line]
    print(f"kill -9 of rank {rank} ({executor}): exit after {took:.1f} s; {lines}")
    cause = f"rank {rank} ({executor}) died without an error"
    survivors = {r for r in range(3) if r != rank}
    for r in survivors:  # each survivor says who it is and who died
        assert any(line.startswith(f"tidal: rank {r} (") and cause in line for line in lines), (r, lines)
    # nobody blames a connection reset (the start-up lines before the kill name no cause)
    stops = [line for line in lines if " stopping: " in line or " failed: " in line]
    assert stops and all(cause in line for line in stops), lines
    assert took < 60, took  # hang guard: measured ~1-3 s on a quiet machine


def test_hung_reward_is_named_within_its_timeout(tmp_path):
    t0 = time.monotonic()
    proc = launch(tmp_path, "--set", "reward.functions=[tests.rewards:hang]", "--set", "reward.timeout_s=3",
                  steps=2, timeout=300)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert "rank 1 (reward) failed: RewardError: reward 'tests.rewards:hang' timed out after 3 s on prompt " \
           in proc.stderr, proc.stderr[-2000:]
    assert ", sample 0" in proc.stderr
    assert took < 120, took  # start-up + 3 s + the watchdog; hang guard only
