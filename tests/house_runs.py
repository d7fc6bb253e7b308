"""The embedded runs whose results the house's refactors must keep (issue 27): GRPO, PPO, DAPO with
dynamic sampling, GRPO with evaluation; and since the objective seam (issue 29) every other algorithm. `python -m tests.house_runs OUT.json` records them;
tests/test_house_digests.py runs them again and compares.

What is compared: every step's rollout digest (the sampled tokens), the eval metrics, and a hash of
the final weights' bytes. Float kernels differ between CPU models (docs/benchmarks.md), so the weights hash is
compared only on the CPU model it was recorded on; the tokens of these short runs are compared on any.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

from tests.e2e import launch, metrics

DENSE = ("--set", "reward.functions=[tests.rewards:length_parity]")

RUNS = {
    "grpo": dict(algo="grpo", nproc=3, args=()),
    "ppo": dict(algo="ppo", nproc=4, args=()),
    "dapo": dict(algo="dapo", nproc=3, args=("--set", "reward.functions=[tests.rewards:flat_for_half_the_prompts]")),
    "eval": dict(algo="grpo", nproc=3, args=("--set", "eval.every=2", "--set", "eval.prompts=8",
                                              "--set", "eval.samples=2", "--set", "eval.temperature=1")),
    # recorded at 341b4e5, before the objective seam (issue 29): every loss pass of every algorithm;
    # batch scope with its KL in the loss (three passes) and in the reward over dp=2 with later
    # mini-batches and epochs; a dense reward so that every pass has a signal
    "reinforce_pp_kl": dict(algo="reinforce_pp", nproc=3, args=(*DENSE, "--set", "algorithm.beta=0.04",
                                                               "--set", "algorithm.kl_in=loss")),
    "reinforce_pp_passes": dict(algo="reinforce_pp", nproc=4, args=(
        *DENSE, "--set", "algorithm.beta=0.04", "--set", "algorithm.kl_in=reward", "--set", "trainer.dp=2",
        "--set", "trainer.mini_batches=2", "--set", "trainer.epochs=2")),
    "gspo": dict(algo="gspo", nproc=3, args=DENSE),
    "rloo": dict(algo="rloo", nproc=3, args=()),
    "dr_grpo": dict(algo="dr_grpo", nproc=3, args=("--set", "algorithm.beta=0.04")),
}
EVAL_KEYS = ("eval/reward_mean", "eval/pass@1", "eval/pass@2", "eval/response_len_mean", "eval/prompts")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def kernels() -> str:
    """The float kernels' instruction set: ATen's capability, and MKL's and oneDNN's caps where set. Another set
    rounds float32 sums otherwise, and a sampled token flips within a few steps (measured: ONEDNN_MAX_CPU_ISA=AVX2
    with MKL and ATen held to AVX2 changed 5 of the 9 runs' rollouts)."""
    import torch

    caps = [f"{k}={os.environ[k]}" for k in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA") if os.environ.get(k)]
    return ",".join([torch.backends.cpu.get_cpu_capability(), *caps])


def weights_sha(run_dir: Path) -> str:
    h = hashlib.sha256()
    for path in sorted((run_dir / "final").rglob("*.safetensors")):
        h.update(path.relative_to(run_dir).as_posix().encode() + path.read_bytes())
    return h.hexdigest()[:16]


def record(name: str, out: Path, *, steps: int = 3) -> dict:
    run = RUNS[name]
    proc = launch(out, *run["args"], nproc=run["nproc"], steps=steps, algo=run["algo"], timeout=600)
    assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
    rows = metrics(out)
    return {"rollout_digests": [r["trainer/rollout_digest"] for r in rows],
            "eval": [{k: r[k] for k in EVAL_KEYS if k in r} for r in rows],
            "eval_samples_sha": _eval_samples_sha(out), "keys": sorted(rows[0]), "weights_sha": weights_sha(out)}


def _eval_samples_sha(out: Path) -> str | None:
    path = out / "eval_samples.jsonl"
    if not path.exists():
        return None
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    text = json.dumps([(r["step"], r["prompt_index"], r["sample"], r["response"], r["reward"]) for r in lines])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        recorded = {"cpu": cpu_model(), "kernels": kernels(), "runs": {name: record(name, Path(tmp) / name) for name in RUNS}}
    Path(sys.argv[1]).write_text(json.dumps(recorded, indent=1) + "\n")
