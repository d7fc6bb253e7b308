"""What on-policy costs: sync, periodic and offpolicy (max_lag 1 and 2) step time on the same job,
one invocation, with the reward each reaches (issue 29).

Part 1, speed: each schedule `--repeats` times (alternating), the first step skipped (warm-up),
medians of step_s; ratios against sync and against periodic measured in the same run; and the
planner's prediction of each, calibrated on the first sync and periodic runs (as `--plan` does).
Two jobs: the default (training-bound here) and one whose generation takes twice its training.

Part 2, learning (LlamaRL Fig. 8 on the embedded task, `--part 2 [--task multi_turn]`): the same
seed and step budget for periodic, offpolicy k = 1, 2, 4 without a correction, and k = 2, 4 with
AIPO and with TIS; mean reward of the first and last 20 steps, and each run's reward curve in one
plot (`--plot PATH`, metrics.png style).

    .venv/bin/python bench/offpolicy.py [--repeats 3] [--steps 8] [--part 1|2] [--plot offpolicy.png]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tidal.launch import jobs  # noqa: E402
from tidal.planner.calibrate import calibrate, fit_concurrency, shapes_of  # noqa: E402
from tidal.planner.plan import predict, predict_offpolicy  # noqa: E402

CONFIGS = {  # the embedded job on this machine's 2 cores: training-bound, then generation-bound
    "default job": [],
    "gen 2x train": ["generator.max_new_tokens=96", "generator.max_batch_prompts=1"],
}

SCHEDULES = {
    "sync": ("--schedule", "sync"),
    "periodic": ("--schedule", "periodic"),
    "offpolicy k=1": ("--schedule", "offpolicy", "--set", "schedule.max_lag=1"),
    "offpolicy k=2": ("--schedule", "offpolicy", "--set", "schedule.max_lag=2"),
}
ABLATION = {
    "periodic": (),
    "k=1": ("schedule.max_lag=1",),
    "k=2": ("schedule.max_lag=2",),
    "k=4": ("schedule.max_lag=4",),
    "k=2 aipo": ("schedule.max_lag=2", "algorithm.correction.kind=aipo"),
    "k=4 aipo": ("schedule.max_lag=4", "algorithm.correction.kind=aipo"),
    "k=2 tis": ("schedule.max_lag=2", "algorithm.correction.kind=tis"),
    "k=4 tis": ("schedule.max_lag=4", "algorithm.correction.kind=tis"),
}


def part1(args, tmp: Path) -> None:
    for config, overrides in CONFIGS.items():
        step_s = {name: [] for name in SCHEDULES}
        for i in range(args.repeats):
            for name, flags in SCHEDULES.items():
                out = tmp / (name if i == 0 else "run")  # the first repeat's sync and periodic calibrate the planner
                rows = jobs.run("grpo", "--overwrite", *flags, output_dir=out,
                                steps=args.steps, overrides=[*overrides, "logging.samples_every=1"], nproc=3).metrics[1:]
                step_s[name].append(statistics.median(r["step_s"] for r in rows))
        predicted = plan(tmp / "sync", tmp / "periodic", steps=args.steps)
        med = {name: statistics.median(v) for name, v in step_s.items()}
        table = [[name, f"{med[name]:.3f}", " ".join(f"{v:.3f}" for v in step_s[name]),
                  f"{med['sync'] / med[name]:.2f}x", f"{med['periodic'] / med[name]:.2f}x",
                  f"{predicted[name]:.3f}", f"{predicted[name] / med[name] - 1:+.0%}"] for name in SCHEDULES]
        print(f"\nPart 1, {config}: {args.repeats} runs x {args.steps - 1} steps per schedule (the first skipped)")
        print(tabulate(table, headers=["schedule", "median s/step", "runs", "vs sync", "vs periodic",
                                       "planner s/step", "planner error"]))


def plan(sync_dir: Path, periodic_dir: Path, *, steps: int) -> dict[str, float]:
    """The planner's step times, calibrated on this job's own sync and periodic runs (as --plan does)."""
    rates = calibrate(sync_dir)
    rates = dataclasses.replace(rates, concurrency=fit_concurrency(rates, periodic_dir))
    shapes = [s for step, s in sorted(shapes_of(sync_dir).items()) if step >= 1]
    sync, periodic, _ = predict(shapes, rates, replicas=1, dp=1)
    return {"sync": sync, "periodic": periodic, **{
        f"offpolicy k={k}": predict_offpolicy(shapes, rates, max_lag=k, replicas=1, dp=1, steps=steps) for k in (1, 2)}}


def part2(args, tmp: Path) -> None:
    curves, table = {}, []
    task = ["rollout=multi_turn"] if args.task == "multi_turn" else []
    for name, sets in ABLATION.items():
        flags = ("--schedule", "offpolicy") if name != "periodic" else ()
        rows = jobs.run("grpo", "--overwrite", *flags, output_dir=tmp / "run",
                        steps=args.ablation_steps, overrides=[*task, *sets], nproc=3).metrics
        rewards = [r["trainer/reward_mean"] for r in rows]
        curves[name] = rewards
        first, last = statistics.mean(rewards[:20]), statistics.mean(rewards[-20:])
        table.append([name, f"{first:.3f}", f"{last:.3f}", f"{last - first:+.3f}",
                      f"{statistics.mean(r['staleness_mean'] for r in rows):.2f}",
                      f"{statistics.median(r['step_s'] for r in rows[1:]):.3f}"])
    print(f"\nPart 2: the embedded {args.task} task, {args.ablation_steps} steps, seed 0, each schedule and correction")
    print(tabulate(table, headers=["run", "reward, first 20", "reward, last 20", "gain", "staleness", "s/step"]))
    if args.plot:
        plot(curves, args.plot)
        print(f"reward curves: {args.plot}")


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, rewards in curves.items():
        window = 10
        smooth = [statistics.mean(rewards[max(0, i - window + 1): i + 1]) for i in range(len(rewards))]
        ax.plot(smooth, label=name, linestyle="-" if "aipo" not in name and "tis" not in name else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("reward_mean (10-step mean)")
    ax.legend(ncol=2, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ablation-steps", type=int, default=200)
    p.add_argument("--part", type=int, choices=[1, 2])
    p.add_argument("--plot", type=Path)
    p.add_argument("--task", choices=["single_turn", "multi_turn"], default="single_turn",
                   help="part 2: the embedded task (multi_turn: the lookup environment's)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in (None, 1):
            part1(args, Path(tmp))
        if args.part in (None, 2):
            part2(args, Path(tmp))


if __name__ == "__main__":
    main()
