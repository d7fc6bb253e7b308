"""Exact resume under torchrun: a run continued from a checkpoint equals the uninterrupted run bit for
bit (weights, optimizer, schedule, old policy, reference, data position); a run stopped by SIGTERM
or killed under `torchrun --max-restarts` finishes equal to one that never stopped.

Every run uses a reward with a signal on the untrained model and AdamW eps=1e-3 (see
test_e2e_parallel.py): the weights move in every step, so equal finals mean something.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e import (ROOT, SMALL, launch, max_abs_diff, metrics, rank_pid, sigterm_when_stalled, start,
                       wait_for_steps, weights)

SIGNAL = ["--set", "reward.functions=[tests.rewards:length_parity]", "--set", "trainer.adam_eps=1e-3",
          "--set", "checkpoint_every=2"]
CASES = {  # name: (extra options, ranks)
    "default": ([], 3),
    "fsdp_dp2": (["--set", "trainer.dp=2", "--set", "trainer.fsdp=true"], 4),
    "tp2": (["--set", "trainer.tp=2"], 4),
    "minibatch_epochs_kl": (["--set", "trainer.mini_batches=2", "--set", "trainer.epochs=2",
                             "--set", "algorithm.beta=0.04"], 3),
    # ZeRO-1 over dp, two pipeline stages: each rank's share of its stage's AdamW state in its own file
    "megatron_dp2_pp2": (["--set", "trainer.backend=megatron", "--set", "trainer.dp=2", "--set", "trainer.pp=2"], 6),
    "dapo_dynamic": (["--set", "reward.functions=[tests.rewards:flat_for_half_the_prompts]",
                      "--set", "algorithm.dynamic_sampling=true"], 3),
    # the embedded lookup task: turns, observations and loss masks resume like single turns
    "multi_turn": (["--set", "rollout=multi_turn"], 3),
}


def _run(out: Path, *args: str, nproc: int, steps: int = 4, algo: str = "grpo") -> Path:
    proc = launch(out, *SIGNAL, *args, nproc=nproc, steps=steps, algo=algo, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _same(a: Path, b: Path, *, steps: range) -> None:
    da, db = ({r["step"]: r["trainer/rollout_digest"] for r in metrics(x)} for x in (a, b))
    assert [db[s] for s in steps] == [da[s] for s in steps]  # the same prompts and samples
    assert (a / "final/model.safetensors").read_bytes() == (b / "final/model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted 4-step run of each case, with checkpoints after steps 1 and 3."""
    root = tmp_path_factory.mktemp("whole")
    return {name: _run(root / name, *opts, nproc=n, algo="dapo" if name.startswith("dapo") else "grpo")
            for name, (opts, n) in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_resume_equals_uninterrupted_run(whole, tmp_path, name):
    opts, nproc = CASES[name]
    ckpt = whole[name] / "checkpoints/step_000001"
    assert json.loads((ckpt / "manifest.json").read_text())["step"] == 1
    run = launch(tmp_path, *SIGNAL, *opts, "--resume", str(ckpt), nproc=nproc, steps=4,
                 algo="dapo" if name.startswith("dapo") else "grpo", timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path)] == [2, 3]
    # the resumed generator's first weights are the checkpoint's: the version the trainer holds
    assert all(r["trainer/staleness_max"] == 0 for r in metrics(tmp_path))
    _same(whole[name], tmp_path, steps=range(2, 4))
    if name == "dapo_dynamic":  # top-ups happened, so the data position includes them
        assert any(r["generator/sampling_rounds"] > 1 for r in metrics(whole[name]))


def test_resume_under_another_layout(whole, tmp_path):
    """Trainer tp=2's checkpoint continued at tp=1: the optimizer state is resharded by
    torch.distributed.checkpoint; equal to the tp=2 run within float noise."""
    run = launch(tmp_path, *SIGNAL, "--resume", str(whole["tp2"] / "checkpoints/step_000001"), steps=4, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    assert max_abs_diff(weights(tmp_path / "final"), weights(whole["tp2"] / "final")) < 1e-5


def test_megatron_resume_names_the_layout_and_backend_it_needs(whole, tmp_path):
    """megatron's optimizer state is per rank: another layout or backend is refused before any rank
    starts, naming what it needs."""
    ckpt = str(whole["megatron_dp2_pp2"] / "checkpoints/step_000001")
    one_stage = [o.replace("trainer.pp=2", "trainer.pp=1") for o in CASES["megatron_dp2_pp2"][0]]
    run = launch(tmp_path / "dp1", *SIGNAL, *one_stage, "--resume", ckpt, nproc=4, steps=4, timeout=400)
    assert run.returncode != 0
    assert ("resumes with the layout it was saved under: trainer.dp=2, trainer.tp=1, trainer.pp=2 (this run: 2, 1, 1)"
            in run.stderr), run.stderr[-3000:]
    torch = [o.replace("backend=megatron", "backend=torch") for o in one_stage]
    run = launch(tmp_path / "torch", *SIGNAL, *torch, "--resume", ckpt, nproc=4, steps=4, timeout=400)
    assert run.returncode != 0
    assert "trainer.backend: 'megatron' -> 'torch'" in run.stderr, run.stderr[-3000:]


def test_resume_refuses_a_damaged_checkpoint(whole, tmp_path):
    ckpt = tmp_path / "step_000001"
    subprocess.run(["cp", "-r", str(whole["default"] / "checkpoints/step_000001"), str(ckpt)], check=True)
    with open(ckpt / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    run = launch(tmp_path / "run", *SIGNAL, "--resume", str(ckpt), steps=4, timeout=400)
    assert run.returncode != 0
    assert f"checkpoint {ckpt}: file model.safetensors has 1000 bytes, manifest.json says" in run.stderr
    (ckpt / "manifest.json").unlink()
    run = launch(tmp_path / "run", *SIGNAL, "--resume", str(ckpt), steps=4, timeout=400)
    assert run.returncode != 0 and f"checkpoint {ckpt}: no manifest.json" in run.stderr


def test_plain_resume_names_a_damaged_newest_checkpoint_and_the_whole_one_before_it(whole, tmp_path):
    """`--resume` (the newest) finds the damage before any rank starts, and points at the previous checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(whole["default"], run)
    (run / "checkpoints/step_000003/model.safetensors").write_bytes(b"")
    proc = subprocess.run([sys.executable, "launch.py", "--algo", "grpo", "--steps", "4", "--output-dir", str(run),
                           *SMALL, *SIGNAL, "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert (f"error: --resume: checkpoint {run / 'checkpoints/step_000003'}: file model.safetensors has 0 bytes"
            in proc.stderr)
    assert proc.stderr.endswith(f"; the newest whole one before it is {run / 'checkpoints/step_000001'}: pass "
                                f"--resume {run / 'checkpoints/step_000001'}\n")


STALL = ["--set", "reward.functions=[tests.rewards:length_parity_then_stall]", "--set", "reward.timeout_s=2000"]


PLACED = {"torchrun": ([], 3), "python": (["--set", "placement=split"], 3),
          # one rank hosting all three: the trainer waits on the reward's outputs on its own rank (it hung until
          # a dropped step closed this rank's outputs before draining its inputs: tidal/controller/loop.py stream)
          "colocated": (["--set", "placement=colocated", "--set", "schedule=sync"], 1)}


@pytest.mark.parametrize("launcher", list(PLACED))
def test_sigterm_in_a_long_step_saves_at_once_and_resumes_equal(whole, tmp_path, launcher):
    """Step 1 stalls in the reward for 1000 s (far past torchrun's 30 s shutdown timeout). SIGTERM to
    the launcher drops that step within seconds, saves step 0 (no cadence had saved it) and exits
    143 naming the resume command; the resumed run equals the uninterrupted one bit for bit. Each
    placement set (a python launch would choose its own), co-located too."""
    out, marker = tmp_path / "run", tmp_path / "stalled"
    placed, nproc = PLACED[launcher]
    returncode, err, took = sigterm_when_stalled(out, marker, *SIGNAL, *STALL, *placed, steps=4,
                                                 torchrun=launcher == "torchrun")
    print(f"\n{launcher}: SIGTERM to exit {took:.1f} s (the stalled step alone: 1000 s)")
    # torchrun's own agent ends in a traceback of its SignalException (exit 1); python launch.py hands on 143
    assert returncode == (1 if launcher == "torchrun" else 128 + signal.SIGTERM), err[-3000:]
    assert took < 60, took  # within torchrun's default 30 s on a quiet machine; 60 s: a guard for a busy one
    line = next(line for line in err.splitlines() if line.startswith("tidal: stopped after step "))
    assert line.startswith(f"tidal: stopped after step 0 (checkpoint {out / 'checkpoints/step_000000'} saved"), line
    assert f"--output-dir {out} " in line and line.endswith(" --resume"), line
    assert (out / "checkpoints/step_000000/manifest.json").is_file()
    assert not list((out / "checkpoints").glob(".tmp*"))
    assert [r["step"] for r in metrics(out)] == [0]  # the dropped step left no record
    resumed = launch(out, *SIGNAL, *STALL, "--resume", steps=4, nproc=nproc, timeout=400)  # no stall now
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3]
    _same(whole["default"], out, steps=range(4))


def test_a_finished_run_is_complete_and_extends_equal(whole, tmp_path):
    """The end of a run is a checkpoint (steps=3: the cadence of 2 saves step 1 only): `--resume` says
    the run is complete and changes nothing; `--resume --steps 4` equals the 4-step run bit for bit."""
    out = _run(tmp_path / "run", nproc=3, steps=3)
    assert (out / "checkpoints/step_000002/manifest.json").is_file()
    before = {p: p.read_bytes() for p in [out / "metrics.jsonl", out / "final/model.safetensors"]}
    again = launch(out, *SIGNAL, "--resume", steps=3, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.strip().endswith(f"tidal: {out} is complete: its checkpoint {out / 'checkpoints/step_000002'} holds "
                                    f"step 2, the last of steps=3; nothing to do (extend it with --resume --steps N, N > 3)")
    assert before == {p: p.read_bytes() for p in before}
    longer = launch(out, *SIGNAL, "--resume", steps=4, timeout=400)
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3]
    _same(whole["default"], out, steps=range(4))
    assert "tidal: done: step 3 of" in longer.stderr and "extend with --resume --steps N" in longer.stderr


def test_killed_trainer_restarts_and_finishes_equal(tmp_path):
    """torchrun --max-restarts 1, kill -9 of the trainer mid-run: the restarted workers resume from
    the newest complete checkpoint by themselves."""
    steps = 10
    proc = start(tmp_path / "run", *SIGNAL, steps=steps, torchrun=("--max-restarts=1",))
    wait_for_steps(tmp_path / "run", 4, proc)
    os.kill(rank_pid(proc.pid, 2), signal.SIGKILL)
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    # the restart says so, and from which checkpoint (every attempt writes one every 2 steps)
    assert f"tidal: restart 1 after a failure: continuing from checkpoint {tmp_path / 'run/checkpoints/step_'}" in err
    whole = launch(tmp_path / "whole", *SIGNAL, steps=steps, timeout=400)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path / "run")] == list(range(steps))
    _same(tmp_path / "whole", tmp_path / "run", steps=range(steps))
