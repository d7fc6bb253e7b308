"""The house's refactors change no result (issues 27, 29 and 42): the embedded GRPO, PPO, DAPO (dynamic
sampling) and evaluation runs give the rollouts, evaluation and final weights recorded before the refactor
(tests/data/house_digests.json, made by `python -m tests.house_runs` at commit 370baf3; the rollouts, evaluation
and weights re-recorded once when the sampler changed its draws, issue 43: one uniform a row instead of
Gumbel noise over the vocabulary; the final weights once more when float32 accumulation in index order
became the default and the optimizer step fused AdamW, issue 43: rollouts and evaluation unchanged; the
recorded keys are 370baf3's; `kernels`, the instruction set they were recorded with, added when the suite ran
with the libraries held to AVX2; reinforce_pp_passes' final weights once more when the native engine moved to fixed
slots, issue 55: its attention reads a sample's keys in place, over another key length than a left-padded
cache's, so the engine's float32 log-probs round otherwise in their last bits, and that run puts the KL into the
reward from them, `tidal/algorithms/kl.py` kl_penalised_rewards; every rollout and evaluation unchanged). Every metrics
key of those rows is still written, under its executor's name now (the recorded rows had flat names),
but for a null one."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.house_runs import RUNS, cpu_model, kernels, record

RECORDED = json.loads((Path(__file__).parent / "data" / "house_digests.json").read_text())


@pytest.mark.parametrize("name", list(RUNS))
def test_the_run_gives_what_it_gave_before_the_refactor(name, tmp_path):
    before, now = RECORDED["runs"][name], record(name, tmp_path / name)
    # every key is still written, but one: a run without evaluation wrote `eval_gen_s: null` on every
    # step (a generator field); it is the evaluation's record now, written on evaluation steps. A recorded
    # flat key is now an executor's field (`loss`: trainer/loss) or a step-level key as it was (`step_s`)
    renamed = {"eval_gen_s": "eval_sampler/gen_s"}  # the evaluation sampler's, once "eval_" + its field
    fields = {k.split("/", 1)[-1] for k in now["keys"] if not k.startswith("eval")} | set(now["keys"])
    gone = {k for k in before["keys"] if renamed.get(k, k) not in fields}
    # (the runs recorded at 370baf3 without evaluation; the others were recorded after that change)
    assert gone == ({"eval_gen_s"} if name in ("grpo", "ppo", "dapo") else set()), gone
    # the runs are float32 with the library's kernels: their tokens are the recorded ones where the kernels are
    # (the same instruction set: this machine and a Xeon with AMX, measured), their weights on the same CPU model
    if kernels() != RECORDED["kernels"]:
        pytest.skip(f"the rollouts were recorded with {RECORDED['kernels']} kernels, these are {kernels()}: a float32 "
                    f"sum rounds otherwise and a sampled token flips (the keys above are checked)")
    assert now["rollout_digests"] == before["rollout_digests"]
    assert now["eval"] == before["eval"]
    assert now["eval_samples_sha"] == before["eval_samples_sha"]
    if cpu_model() == RECORDED["cpu"]:  # float kernels differ between CPU models: the weights may too
        assert now["weights_sha"] == before["weights_sha"]
