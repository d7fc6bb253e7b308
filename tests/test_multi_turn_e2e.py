"""Multi-turn runs end to end under torchrun (the embedded lookup task, `--set rollout=multi_turn`):
sync == periodic bit for bit with exact numerics, whatever the tools' latency, what metrics.jsonl, samples.jsonl and the console show of the turns,
PPO (GAE over responses with holes), and an environment that fails: scored 0 and counted, or
stopping the run with one line naming it. Layouts and resume: tests/test_e2e_parallel.py and
tests/test_resume.py carry a multi-turn case."""
from __future__ import annotations

import json

import pytest

from tests.e2e import launch, metrics

MULTI_TURN = ["--set", "rollout=multi_turn"]


def _run(out, *args, algo="grpo", nproc=3):
    proc = launch(out, *MULTI_TURN, *args, algo=algo, nproc=nproc, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out / "console.txt").write_text(proc.stdout + proc.stderr)
    return out


EXACT = ["--set", "model.numerics=exact"]


@pytest.fixture(scope="module")
def periodic(tmp_path_factory):
    """Periodic, 2 replicas, continuous admission, each environment call 0-300 ms (unseeded): its answers
    come back in an order of their own, while the engine decodes the other samples."""
    return _run(tmp_path_factory.mktemp("mt_periodic"), *EXACT, "--schedule", "periodic", "--set",
                "multi_turn.env=tests.envs:SlowLookup", "--set", "generator.replicas=2", nproc=4)


@pytest.fixture(scope="module")
def sync(tmp_path_factory):
    """Sync, one replica, chunked admission, the instant lookup environment."""
    return _run(tmp_path_factory.mktemp("mt_sync"), *EXACT, "--schedule", "sync", "--set", "generator.admission=chunked")


def test_sync_equals_periodic_bit_for_bit(periodic, sync):
    """And the tools' latency changes nothing (issue 45): with model.numerics=exact no row depends on
    the rows it was decoded beside, or on when its observation came back."""
    assert [r["trainer/rollout_digest"] for r in metrics(periodic)] == [r["trainer/rollout_digest"] for r in metrics(sync)]
    assert (periodic / "final/model.safetensors").read_bytes() == (sync / "final/model.safetensors").read_bytes()


def test_turns_in_metrics_samples_and_console(periodic):
    rows = metrics(periodic)
    for row in rows:
        # a random-init model rarely writes a digit, so it looks, reads, and answers: 2 or 3 turns
        assert 1.5 < row["generator/turns_mean"] <= 3 and row["generator/turns_mean"] == row["generator/turns_mean"]
        assert row["generator/env_s"] > 0 and row["generator/env_errors"] == 0
        assert row["trainer/logp_mismatch_max"] == 0.0  # the trainer's log-probs of the model's tokens, as sampled
        assert 0 <= row["generator/env_wait_s"] < row["generator/gen_s"]
    lines = [json.loads(line) for line in (periodic / "samples.jsonl").read_text().splitlines()]
    for line in lines:
        roles = [t["role"] for t in line["turns"]]
        assert roles[0] == "assistant" and roles[::2] == ["assistant"] * len(roles[::2])
        assert line["turns"][0]["tokens"] == 1  # the look: the lookup environment caps it at one token
        assert all(r == "tool" for r in roles[1::2])
        assert line["length"] == line["model_tokens"] + sum(t["tokens"] for t in line["turns"] if t["role"] == "tool")
        assert "?" in line["prompt"]  # the digit is behind the tool
        for t in line["turns"]:
            if t["role"] == "tool":
                assert any(c.isdigit() for c in t["text"])  # the look shows it
    console = (periodic / "console.txt").read_text()
    assert "\n  model:    " in console and "\n  env:      " in console


def test_ppo_trains_multi_turn_responses(tmp_path):
    """The critic's values and GAE over responses whose observations are holes in the loss mask."""
    rows = metrics(_run(tmp_path, algo="ppo", nproc=4))
    assert all(r["generator/turns_mean"] > 1.5 for r in rows)
    assert all(0 < r["critic/value_loss"] < float("inf") for r in rows)


ENV_FAILS = ["--set", "multi_turn.env=tests.envs:BreaksOnSomePrompts"]


def test_a_failing_environment_scores_zero_and_is_counted(tmp_path):
    out = _run(tmp_path, *ENV_FAILS, "--steps", "2")
    rows = metrics(out)
    assert sum(r["generator/env_errors"] for r in rows) > 0
    lines = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    failed = [line for line in lines if line["env_error"]]
    assert failed and all(line["reward"] == 0 for line in failed)
    assert "environment 'tests.envs:BreaksOnSomePrompts' failed at step 0, prompt" in failed[0]["env_error"]
    console = (out / "console.txt").read_text()
    assert "samples ended by an environment error at step 0 (scored 0, multi_turn.on_error=zero); the first: " \
           "environment 'tests.envs:BreaksOnSomePrompts' failed at step 0, prompt " in console


def test_on_error_fail_stops_the_run_naming_environment_step_prompt_and_sample(tmp_path):
    proc = launch(tmp_path, *MULTI_TURN, *ENV_FAILS, "--set", "multi_turn.on_error=fail", timeout=400)
    assert proc.returncode != 0
    assert "environment 'tests.envs:BreaksOnSomePrompts' failed at step 0, prompt " in proc.stderr
    assert ", sample " in proc.stderr and "step() raised RuntimeError: the tool is down" in proc.stderr


def test_bad_environment_name_fails_before_any_rank_starts(tmp_path):
    proc = launch(tmp_path, *MULTI_TURN, "--set", "multi_turn.env=tests.envs:Nope", timeout=120)
    assert proc.returncode != 0
    assert "multi_turn.env='tests.envs:Nope': module 'tests.envs' has no attribute 'Nope'" in proc.stderr
