"""The warm launcher (tidal/launch/warm.py) against torchrun: the same job gives the same rollouts and the same
final bytes; a job past its timeout is killed (a failing rank's error and exit code: tests/test_faults.py and the
other jobs of the suite, which run warm)."""
from __future__ import annotations

import subprocess

import pytest

from tidal.launch import jobs
from tests.e2e import SMALL, metrics

ARGS = (*SMALL, "--set", "reward.functions=[tests.rewards:length_parity]")


def test_a_warm_job_equals_the_same_job_under_torchrun(tmp_path):
    for name, warm in (("torchrun", False), ("warm", True)):
        job = jobs.run("grpo", *ARGS, steps=2, output_dir=tmp_path / name, nproc=3, timeout=300, warm=warm)
        assert job.returncode == 0
    digests = [[r["trainer/rollout_digest"] for r in metrics(tmp_path / name)] for name in ("torchrun", "warm")]
    assert digests[0] == digests[1] and len(digests[0]) == 2
    final = [(tmp_path / name / "final/model.safetensors").read_bytes() for name in ("torchrun", "warm")]
    assert final[0] == final[1]


# the deadline under test, not a hang guard: the reward hangs for good, so the job outlives any deadline
KILL_AFTER_S = 6


def test_a_warm_job_past_its_timeout_is_killed(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        jobs.run("grpo", *SMALL, "--set", "reward.functions=[tests.rewards:hang]", "--set", "reward.timeout_s=600",
                 steps=1, output_dir=tmp_path, nproc=3, timeout=KILL_AFTER_S, warm=True)
    # the launcher is free again: the next job runs
    assert jobs.run("grpo", *SMALL, steps=1, output_dir=tmp_path / "next", nproc=3, timeout=120, warm=True).returncode == 0
