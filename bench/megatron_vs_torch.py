"""The megatron trainer backend vs the torch backend: the same job, the same seed, one invocation.

For each config, run the job with trainer.backend=torch and =megatron (--repeats each, alternating),
skip step 0 (warm-up) and take medians of step_s and train_s (the trainer's compute in the streamed
phase). "same rollouts": every step's rollout digest equal across the two backends (the generator
sampled with weights pushed by either trainer alike).

    .venv/bin/python bench/megatron_vs_torch.py [--repeats 3] [--steps 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tidal.launch import jobs  # noqa: E402

CONFIGS = {  # name: (ranks, overrides)
    "embedded job (tp=1)": (3, []),
    "embedded job, varlen rows": (3, ["trainer.shared_prompt=off"]),
    "embedded job, trainer tp=2": (4, ["trainer.tp=2"]),
    "embedded job, trainer dp=2": (4, ["trainer.dp=2"]),
}


def run(nproc: int, overrides: list[str], backend: str, steps: int, out: Path) -> list[dict]:
    return jobs.run("grpo", "--overwrite", output_dir=out, nproc=nproc,
                    steps=steps, overrides=[f"trainer.backend={backend}", *overrides]).metrics


def med(runs: list[list[dict]], key: str) -> float:
    """The median over runs of each run's median (step 0 skipped)."""
    return statistics.median(statistics.median(r[key] for r in rows[1:]) for rows in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (nproc, overrides) in CONFIGS.items():
            runs = {"torch": [], "megatron": []}
            for k in range(args.repeats):
                for backend in runs:
                    runs[backend].append(run(nproc, overrides, backend, args.steps, Path(tmp) / f"{backend}{k}"))
            same = all([r["trainer/rollout_digest"] for r in runs["torch"][0]] == [r["trainer/rollout_digest"] for r in rows]
                       for rows in runs["megatron"])
            t, m = (med(runs[b], "step_s") for b in ("torch", "megatron"))
            tt, mt = (med(runs[b], "trainer/train_s") for b in ("torch", "megatron"))
            table.append([name, f"{t:.3f}", f"{m:.3f}", f"{m / t:.2f}x", f"{tt:.3f}", f"{mt:.3f}", f"{mt / tt:.2f}x",
                          "yes" if same else "no"])
            print(tabulate(table[-1:], tablefmt="plain"), flush=True)
    print(f"\nmedians of {args.repeats} runs x {args.steps - 1} steps (step 0 skipped)")
    print(tabulate(table, headers=["config", "torch step s", "megatron step s", "ratio", "torch train s",
                                   "megatron train s", "ratio", "same rollouts"], tablefmt="github"))


if __name__ == "__main__":
    main()
