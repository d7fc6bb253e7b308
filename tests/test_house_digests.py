"""The house's refactors change no result (issue 27): the embedded GRPO, PPO, DAPO (dynamic sampling)
and evaluation runs give the rollouts, evaluation and final weights recorded before the refactor
(tests/data/house_digests.json, made by `python -m tests.house_runs` at commit 370baf3). Every
metrics key of those rows is still written (the flat names are aliases now)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.house_runs import RUNS, cpu_model, record

RECORDED = json.loads((Path(__file__).parent / "data" / "house_digests.json").read_text())


@pytest.mark.parametrize("name", list(RUNS))
def test_the_run_gives_what_it_gave_before_the_refactor(name, tmp_path):
    before, now = RECORDED["runs"][name], record(name, tmp_path / name)
    assert now["rollout_digests"] == before["rollout_digests"]
    assert now["eval"] == before["eval"]
    assert now["eval_samples_sha"] == before["eval_samples_sha"]
    assert set(before["keys"]) <= set(now["keys"]), set(before["keys"]) - set(now["keys"])
    if cpu_model() == RECORDED["cpu"]:  # float kernels differ between CPU models: the weights may too
        assert now["weights_sha"] == before["weights_sha"]
