"""Failing rewards under reward.on_error=zero show: a console warning when most of a step's rewards
failed, naming the first error by its data row, and a stop once every reward failed K steps in a row."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tidal.controller.metrics import reward_warning
from tidal.executors.reward.config import RewardConfig
from tidal.executors.reward.executor import Reward
from tidal.executors.reward.functions import RewardError
from tests.e2e import ROOT, launch, metrics

FIRST = "reward 'he:score' failed on data row 17 (task_id HumanEval/16), sample 3: ZeroDivisionError: x"


def test_the_warning_needs_more_than_half_failed_and_names_count_first_error_and_setting():
    row = {"step": 4, "trainer/samples": 16, "trainer/reward_failures": 12, "trainer/reward_first_error": FIRST}
    assert reward_warning(row) == (f"warning: step 4: 12 of 16 rewards failed and scored 0 (reward.on_error=zero); "
                                   f"the first: {FIRST}")
    assert reward_warning({**row, "trainer/reward_failures": 8}) is None  # half is not more than half
    assert reward_warning({**row, "trainer/reward_failures": 0, "trainer/reward_first_error": None}) is None
    assert reward_warning({"step": 0, "trainer/groups": 4}) is None  # a graph whose trainer counts no rewards
    long = reward_warning({**row, "trainer/reward_first_error": "E" * 1000})
    assert long.endswith("E" * 297 + "...") and len(long) < 400  # one console line, not a wall


def _counter(**cfg) -> Reward:
    return Reward(config=RewardConfig(on_error="zero", **cfg), functions=["tests.rewards:boom"], tokenizer_path=None)


def test_the_stop_counts_steps_in_a_row_whose_every_reward_failed():
    reward = _counter(max_failed_steps=2)
    reward._stop_if_all_failed(failures=16, samples=16, first_error=FIRST)
    reward._stop_if_all_failed(failures=15, samples=16, first_error=FIRST)  # one scored: the count restarts
    reward._stop_if_all_failed(failures=0, samples=0, first_error=None)  # no group (a replica's empty share)
    reward._stop_if_all_failed(failures=16, samples=16, first_error=FIRST)
    with pytest.raises(RewardError) as e:
        reward._stop_if_all_failed(failures=16, samples=16, first_error=FIRST)
    assert str(e.value) == (f"every reward failed in 2 steps in a row (scored 0 by reward.on_error=zero); the first "
                            f"error: {FIRST}; fix the reward, or set reward.max_failed_steps=0 to train on")
    never = _counter(max_failed_steps=0)
    for _ in range(5):
        never._stop_if_all_failed(failures=16, samples=16, first_error=FIRST)


def test_a_run_whose_rewards_all_fail_warns_then_stops_naming_row_and_id(tmp_path):
    """4 prompts of a data file with a task_id column, a reward that always raises: step 0 warns on the
    console with its first error (data row and task_id), step 1 stops the job on every rank."""
    data = tmp_path / "data.jsonl"
    words = [("ana", "has", 3, "cats"), ("bo", "sees", 5, "dogs"), ("cy", "finds", 7, "cups"), ("dee", "keeps", 1, "hats")]
    data.write_text("".join(f'{{"prompt": "{n} {v} {d} {o} . how many ? answer:", "task_id": "T/{i}"}}\n'
                            for i, (n, v, d, o) in enumerate(words)))
    out = tmp_path / "run"
    proc = launch(out, "--set", f"data.path={data}", "--set", "reward.functions=[tests.rewards:boom]",
                  "--set", "reward.on_error=zero", "--set", "reward.max_failed_steps=2", steps=4, timeout=120)
    assert proc.returncode != 0
    console = proc.stdout + proc.stderr
    warnings = [line for line in console.splitlines() if line.startswith("warning: step 0:")]
    assert len(warnings) == 1, console[-3000:]
    first = re.fullmatch(r"warning: step 0: 16 of 16 rewards failed and scored 0 \(reward\.on_error=zero\); the first: "
                         r"(reward 'tests\.rewards:boom' failed on data row (\d) \(task_id T/(\d)\), sample 0: "
                         r"ZeroDivisionError: grader bug)", warnings[0])
    assert first, warnings[0]
    assert int(first[2]) == int(first[3]) + 1  # task T/i is on line i+1: the row named is the prompt's own
    stop = ("tidal: rank 1 (reward) failed: RewardError: every reward failed in 2 steps in a row (scored 0 by "
            "reward.on_error=zero); the first error: reward 'tests.rewards:boom' failed on data row ")
    assert proc.stderr.count(stop) == 1, proc.stderr[-3000:]
    assert "ZeroDivisionError: grader bug; fix the reward, or set reward.max_failed_steps=0" in proc.stderr
    rows = metrics(out)
    assert rows[0]["step"] == 0 and len(rows) < 4  # stopped at step 1, not run to the end
    assert (rows[0]["trainer/reward_failures"], rows[0]["trainer/samples"]) == (16, 16)
    assert rows[0]["trainer/reward_first_error"] == first[1]


def test_a_reward_with_the_wrong_signature_stops_the_launch_before_any_rank(tmp_path):
    proc = subprocess.run([sys.executable, "launch.py", "--algo", "grpo", "--steps", "1", "--output-dir",
                           str(tmp_path / "run"), "--set", "reward.functions=[math:floor]"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == ("error: reward 'math:floor': its signature (x, /) cannot take the 3 positional arguments "
                           "(prompt, response, sample) a reward is called with\n")
    assert not (tmp_path / "run").exists()  # refused before the ranks (which would make the run dir) started
