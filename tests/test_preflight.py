"""Bad inputs fail before any rank starts: exit 2, one stderr line naming the field or file, in
seconds. `python launch.py` starts the ranks itself; its own output stays the workers' lines."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal.modeling.hf import load_model, load_tokenizer, save_hf
from tidal.launch import jobs
from tidal.launch.cli import _run_of
from tidal.launch.selflaunch import cause, without_max_restarts
from tests.e2e import ROOT, SMALL, metrics, rank_pid, wait_for_steps

WEIGHTS = "model.safetensors, model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json"
# ~2 s on an idle machine (imports + the checks); the bound only catches a start-up or a hang
# without flaking when CI shares its 2 cores
BOUND_S = 60


def _env() -> dict:
    # a test run under torchrun must not make launch.py think it is a rank
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "TORCHELASTIC_RUN_ID")}


def _launch(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "launch.py", "--algo", "grpo", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=_env())
    return proc, time.monotonic() - t0


def _torchrun(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3", "--standalone",
                           "launch.py", "--algo", "grpo", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env=_env())
    return proc, time.monotonic() - t0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model")
    save_hf(load_model(None), load_tokenizer(None), out)
    return out


def _model_without(model_dir: Path, tmp: Path, *names: str) -> Path:
    out = tmp / "model"
    shutil.copytree(model_dir, out)
    for name in names:
        (out / name).unlink()
    return out


def _case(name: str, tmp: Path, model_dir: Path) -> tuple[list[str], str]:
    """(arguments, the one stderr line they must give) of each bad input."""
    if name == "missing_data":
        return ["--set", f"data.path={tmp / 'nope.jsonl'}"], f"error: data.path: prompt file '{tmp / 'nope.jsonl'}' does not exist"
    if name == "bad_jsonl_line":
        data = tmp / "prompts.jsonl"
        data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", \n')
        return ["--set", f"data.path={data}"], f"error: data.path: {data}:2: invalid JSON: "
    if name == "model_without_config":
        d = _model_without(model_dir, tmp, "config.json")
        return ["--set", f"model.path={d}"], (f"error: model.path: no Hugging Face model directory at '{d}' "
                                              f"(expected {d / 'config.json'})")
    if name == "model_without_weights":
        d = _model_without(model_dir, tmp, "model.safetensors")
        return ["--set", f"model.path={d}"], f"error: model.path: model directory '{d}' has no weights (looked for {WEIGHTS})"
    if name == "model_without_tokenizer":
        d = _model_without(model_dir, tmp, "tokenizer.json")  # tokenizer_config.json alone: `empty prompt` before
        return ["--set", f"model.path={d}"], (f"error: model.path: model directory '{d}' has no tokenizer (looked for "
                                              f"tokenizer.json, or tokenizer_config.json with tokenizer.model or vocab.json)")
    if name == "output_dir_is_a_file":
        f = tmp / "out"
        f.write_text("")
        return ["--output-dir", str(f)], f"error: output dir {f} is a file, not a directory"
    if name == "output_dir_holds_a_run":
        (tmp / "config.json").write_text("{}")
        (tmp / "metrics.jsonl").write_text("")
        return ["--output-dir", str(tmp)], (f"error: output dir {tmp} already holds a run (config.json, metrics.jsonl); "
                                            f"pass --resume to continue it or --overwrite to replace it")
    if name == "one_sample_per_prompt":
        return ["--set", "generator.samples_per_prompt=1"], (
            "error: generator.samples_per_prompt=1 with --algo grpo: its advantages compare each sample with the "
            "others of its prompt's group, so every advantage would be 0 and nothing would train")
    if name == "reward_column_missing":  # DeepScaleR-style rows, prompt column mapped, answer column not
        data = tmp / "deepscaler.jsonl"
        data.write_text('{"problem": "1+1?", "solution": "2"}\n')
        return ["--set", f"data.path={data}", "--set", "data.prompt_key=problem"], (
            f"error: data.path: reward 'math_verify' reads the column 'answer', which row 1 of {data} lacks (it has "
            f"'problem', 'solution'); set data.answer_key to the column that holds the answer, or set reward.functions")
    if name == "greedy_groups":
        return ["--set", "generator.temperature=0"], (
            "error: generator.temperature=0 (greedy) with --algo grpo: the 16 samples of a prompt are the same text")
    if name == "resume_and_overwrite":
        return ["--output-dir", str(tmp), "--resume", "--overwrite"], "error: --resume and --overwrite together"
    raise KeyError(name)


CASES = ["missing_data", "bad_jsonl_line", "model_without_config", "model_without_weights", "model_without_tokenizer",
         "output_dir_is_a_file", "output_dir_holds_a_run", "one_sample_per_prompt", "greedy_groups", "reward_column_missing",
         "resume_and_overwrite"]


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_line_before_start(name, tmp_path, model_dir):
    args, line = _case(name, tmp_path, model_dir)
    proc, took = _launch(*args, "--steps", "2")
    print(f"\n{name}: python launch.py exit {proc.returncode} in {took:.2f} s")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith(line), proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert took < BOUND_S, took


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any directory: chmod does not bind")
def test_output_dir_in_a_read_only_dir(tmp_path):
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        proc, took = _launch("--output-dir", str(parent / "run"), "--steps", "2")
    finally:
        parent.chmod(0o700)
    print(f"\nread-only parent: python launch.py exit {proc.returncode} in {took:.2f} s")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: output dir {parent / 'run'} cannot be created: {parent} is not "
                                   f"writable (Permission denied)")
    assert took < BOUND_S, took


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="no sysfs here")
def test_output_dir_where_even_root_cannot_write():
    # sysfs refuses mkdir to everyone (root included, where a permission check would pass)
    proc, took = _launch("--output-dir", "/sys/tidal/run", "--steps", "2")
    print(f"\nsysfs parent: python launch.py exit {proc.returncode} in {took:.2f} s")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: output dir /sys/tidal/run cannot be created: /sys is not writable (")
    assert len(proc.stderr.strip().splitlines()) == 1 and took < BOUND_S


@pytest.mark.parametrize("name", ["missing_data", "output_dir_holds_a_run"])
def test_bad_input_under_torchrun(name, tmp_path, model_dir):
    # every rank checks before it loads anything; only rank 0 prints (torchrun's own block may follow)
    args, line = _case(name, tmp_path, model_dir)
    proc, took = _torchrun(*args, "--steps", "2")
    print(f"\n{name}: torchrun exit {proc.returncode} in {took:.2f} s")
    assert proc.returncode != 0
    assert sum(ln.startswith(line) for ln in proc.stderr.splitlines()) == 1, proc.stderr[-3000:]
    assert took < BOUND_S, took


def test_resume_without_output_dir_needs_a_checkpoint_path(tmp_path):
    proc, _ = _launch("--resume")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --resume needs --output-dir"), proc.stderr
    # <run>/checkpoints/step_N names its run: the output dir follows, and the missing checkpoint is named
    ckpt = tmp_path / "run" / "checkpoints" / "step_000003"
    proc, _ = _launch("--resume", str(ckpt))
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: --resume: no checkpoint directory at {ckpt}"
    assert _run_of(str(ckpt)) == tmp_path / "run"
    assert _run_of(str(tmp_path / "step_000003")) is None and _run_of(str(tmp_path / "checkpoints" / "x")) is None


def test_one_sample_per_prompt_is_fine_without_a_group_baseline():
    refused, _ = _launch("--dry-run", "--set", "generator.samples_per_prompt=1")
    assert refused.returncode == 2  # grpo: group-relative
    proc = subprocess.run([sys.executable, "launch.py", "--algo", "reinforce_pp", "--dry-run", "--set",
                           "generator.samples_per_prompt=1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr  # scores normalised over the batch
    proc = subprocess.run([sys.executable, "launch.py", "--algo", "reinforce_pp", "--dry-run", "--set",
                           "generator.samples_per_prompt=1", "--set", "algorithm.baseline=true"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "generator.samples_per_prompt=1 with --algo reinforce_pp" in proc.stderr


def test_a_saved_model_dir_passes(model_dir):
    proc, _ = _launch("--dry-run", "--set", f"model.path={model_dir}")
    assert proc.returncode == 0, proc.stderr


def test_max_restarts_is_not_passed_to_the_ranks():
    argv = ["--steps", "2", "--max-restarts", "3", "--set", "a=1", "--max-restarts=2", "--max-r", "1", "--seed", "0"]
    assert without_max_restarts(argv) == ["--steps", "2", "--set", "a=1", "--seed", "0"]


def _no_launcher_noise(stderr: str) -> None:
    for noise in ("ChildFailedError", "OMP_NUM_THREADS", "torch/distributed/elastic", "Traceback"):
        assert noise not in stderr, stderr[-3000:]


def test_self_launch_runs_a_job_to_the_end(tmp_path):
    """From Python (tidal/launch/jobs.py, what `python launch.py` runs): the ranks start, and the run's output
    dir and metrics come back."""
    t0 = time.monotonic()
    job = jobs.run("grpo", overrides={"data.prompts_per_step": 4, "generator.samples_per_prompt": 4,
                                      "generator.max_new_tokens": 4, "generator.max_batch_prompts": 2},
                   steps=2, output_dir=tmp_path, timeout=300)
    print(f"\n2-step job: python launch.py exit {job.returncode} in {time.monotonic() - t0:.2f} s")
    assert job.output_dir == tmp_path and (tmp_path / "final" / "model.safetensors").is_file()
    assert [r["step"] for r in job.metrics] == [0, 1]
    _no_launcher_noise(job.stderr)
    # the same dir again: refused, and --overwrite starts over
    proc, _ = _launch("--steps", "1", "--output-dir", str(tmp_path), *SMALL)
    assert proc.returncode == 2 and "already holds a run (config.json, metrics.jsonl, checkpoints, final)" in proc.stderr
    proc, _ = _launch("--steps", "1", "--output-dir", str(tmp_path), "--overwrite", *SMALL, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path)] == [0]


# the tests that name a rank set the layout: a python launch chooses its own from this machine's rates
SPLIT = ["--set", "placement=split"]


def test_self_launch_hands_on_a_failed_rank_without_torch_noise(tmp_path):
    """A failed job (from Python: JobFailed, with its exit code and what it printed)."""
    with pytest.raises(jobs.JobFailed) as failed:
        jobs.run("grpo", *SMALL, *SPLIT, "--set", "reward.functions=[tests.rewards:boom]", steps=1,
                 output_dir=tmp_path, timeout=300)
    stderr = str(failed.value)
    assert not re.search(r"exited with (0|2):", stderr), stderr[-3000:]
    assert "tidal: rank 1 (reward) failed: RewardError" in stderr
    assert "ChildFailedError" not in stderr and "torch/distributed/elastic" not in stderr, stderr[-3000:]


def test_self_launch_exits_143_on_sigterm(tmp_path):
    """Through the installed `tidal` command, away from the checkout: its ranks run the package
    (`python -m tidal`), and the resume line names the command the user typed."""
    command = Path(sys.executable).with_name("tidal")
    proc = subprocess.Popen([str(command), "--algo", "grpo", "--steps", "500", "--output-dir",
                             str(tmp_path / "run"), *SMALL], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=_env())
    tmp_path = tmp_path / "run"
    try:
        deadline = time.monotonic() + 240
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    _no_launcher_noise(stderr)
    assert "; resume with: tidal --algo grpo --steps 500 " in stderr, stderr[-3000:]


def test_self_launch_names_a_killed_rank_and_exits_128_plus_the_signal(tmp_path):
    proc = subprocess.Popen([sys.executable, "launch.py", "--algo", "grpo", "--steps", "500", "--output-dir",
                             str(tmp_path), *SMALL, *SPLIT], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=_env())
    try:
        wait_for_steps(tmp_path, 2, proc)
        os.kill(rank_pid(proc.pid, 2), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, stderr[-3000:]
    assert "tidal: rank 2 (trainer) was killed by SIGKILL" in stderr, stderr[-3000:]
    _no_launcher_noise(stderr)


def test_the_rank_killed_by_a_signal_is_the_cause():
    """torch's first failure is the earliest by a whole-second timestamp: a peer's echo (exit 17) of
    the kill may come first; the killed rank is the cause."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    echo, killed = ProcessFailure(0, 101, 17, "/nonexistent"), ProcessFailure(2, 103, -9, "/nonexistent")
    echo.timestamp, killed.timestamp = 100, 101
    exc = ChildFailedError("launch.py", {0: echo, 2: killed})
    assert exc.get_first_failure()[0] == 0 and cause(exc) == (2, killed)
    only_echoes = ChildFailedError("launch.py", {1: ProcessFailure(1, 102, 17, "/nonexistent")})
    assert cause(only_echoes)[0] == 1
    # SIGTERM to one rank: the job stops gracefully (143) and the agent's SIGTERM ends a rank still
    # finishing; the graceful stop is the outcome, not a kill to report
    stopped, terminated = ProcessFailure(0, 101, 143, "/nonexistent"), ProcessFailure(2, 103, -15, "/nonexistent")
    assert cause(ChildFailedError("launch.py", {0: stopped, 2: terminated})) == (0, stopped)


def test_reward_columns_checked_by_dry_run_and_mapping_fixes_it(tmp_path):
    """--dry-run runs the data checks too; mapping the answer's column (MATH-style `solution`) passes."""
    data = tmp_path / "math.jsonl"
    data.write_text('{"problem": "1+1?", "solution": "2"}\n')
    args = ["--dry-run", "--set", f"data.path={data}", "--set", "data.prompt_key=problem"]
    refused, _ = _launch(*args)
    assert refused.returncode == 2 and "reward 'math_verify' reads the column 'answer'" in refused.stderr
    mapped, _ = _launch(*args, "--set", "data.answer_key=solution")
    assert mapped.returncode == 0, mapped.stderr[-2000:]
    assert "data.answer_key" in mapped.stdout and "--set" in mapped.stdout  # the sources table
    # a mapped column the rows lack is named, never silently replaced by another column
    wrong, _ = _launch(*args, "--set", "data.answer_key=answer_text")
    assert wrong.returncode == 2 and "field 'answer_text' (data.answer_key) is missing" in wrong.stderr, wrong.stderr
    assert f"{data}:1" in wrong.stderr
