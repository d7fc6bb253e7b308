"""Whole jobs under torchrun, for the end-to-end tests."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from controller.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--set", "data.prompts_per_step=4", "--set", "generator.samples_per_prompt=4",
         "--set", "generator.max_new_tokens=4", "--set", "generator.max_batch_prompts=2"]  # 2 inference chunks
REQUIRED = {"step", "reward_mean", "reward_std", "response_len_mean", "loss", "kl", "grad_norm", "gen_s",
            "train_s", "push_s", "step_s", "tokens", "tpspd", "rollout_digest"}


def launch(out: Path, *args: str, nproc: int = 3, steps: int = 3, timeout: float = 240,
           algo: str = "grpo") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           "launch.py", "--algo", algo, "--steps", str(steps), "--output-dir", str(out), *SMALL, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of an HF directory written by the trainer (final/ or a checkpoint)."""
    return load_file(path / "model.safetensors")


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)
