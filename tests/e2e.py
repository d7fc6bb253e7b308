"""Whole jobs under torchrun, for the end-to-end tests."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tidal.launch import jobs

ROOT = Path(__file__).resolve().parents[1]
# 2 inference chunks; no PNGs at the end (1.5 s a job; the tests that read them turn them on)
SMALL = ["--set", "data.prompts_per_step=4", "--set", "generator.samples_per_prompt=4",
         "--set", "generator.max_new_tokens=4", "--set", "generator.max_batch_prompts=2", "--set", "logging.plots=false"]
# the tests' jobs fork from the warm launcher; tests_vllm/ and tests_gpu/ set False (torchrun): vLLM's CPU shared
# memory and a GPU's teardown want a rank that exits as a process does, not by os._exit from a fork
WARM = True
REQUIRED = {"step", "trainer/reward_mean", "trainer/reward_std", "trainer/response_len_mean", "trainer/loss", "trainer/kl",
            "trainer/grad_norm", "generator/gen_s", "trainer/train_s", "trainer/push_s", "step_s", "trainer/tokens", "tpspd",
            "trainer/rollout_digest"}


def launch(out: Path, *args: str, nproc: int = 3, steps: int = 3, timeout: float = 240,
           algo: str = "grpo", defaults: bool = False, env: dict | None = None) -> jobs.Job:
    """The job to its end, its `nproc` ranks forked by the warm launcher (tidal/launch/warm.py: torchrun's rank
    environment without the ~9 s of imports a job; what needs torchrun itself uses `start`). defaults: the
    embedded job as `make demo` runs it, without the small batch of SMALL. env: added to this process's
    environment (e.g. TIDAL_THREADS=1: the same float sums in every layout)."""
    return jobs.run(algo, *([] if defaults else SMALL), *args, steps=steps, output_dir=out, nproc=nproc,
                    timeout=timeout, env=env, check=False, warm=WARM)


metrics = jobs.read_metrics


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of an HF directory written by the trainer (final/ or a checkpoint)."""
    return load_file(path / "model.safetensors")


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def start(out: Path, *args: str, steps: int, nproc: int = 3, torchrun: tuple[str, ...] = ()) -> subprocess.Popen:
    """A job running in the background (for signals and kills), its output piped."""
    return jobs.start("grpo", *SMALL, *args, steps=steps, output_dir=out, nproc=nproc, launcher_args=torchrun)


def wait_for_steps(out: Path, n: int, proc: subprocess.Popen, *, timeout: float = 300) -> None:
    """Until metrics.jsonl has `n` rows (the job is past start-up and training)."""
    deadline = time.monotonic() + timeout
    path = out / "metrics.jsonl"
    while not (path.is_file() and len(path.read_text().splitlines()) >= n):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {n} steps in {timeout} s"
        time.sleep(0.1)


def rank_pid(torchrun_pid: int, rank: int) -> int:
    """The worker process of global rank `rank`, a child of the torchrun we started."""
    for task in Path(f"/proc/{torchrun_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in env:
                return int(child)
    raise AssertionError(f"rank {rank} is not a child of {torchrun_pid}")


def sigterm_when_stalled(out: Path, marker: Path, *args: str, steps: int, torchrun: bool = True,
                         stall_after: int = 16) -> tuple[int, str, float]:
    """Start a job whose reward stalls (tests.rewards:length_parity_then_stall, in `args`) after
    `stall_after` calls, writing `marker`; SIGTERM its launcher once it stalls. -> (exit code,
    stderr, seconds from the signal to the exit)."""
    import os
    import signal

    env = {**os.environ, "TIDAL_TEST_STALL_AFTER": str(stall_after), "TIDAL_TEST_STALL_FILE": str(marker)}
    cmd = jobs.command("grpo", *SMALL, *args, steps=steps, output_dir=out, nproc=3 if torchrun else None)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the reward never stalled"
            time.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=150)  # hang guard: a stalled step alone takes 1000 s
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err, time.monotonic() - t0

