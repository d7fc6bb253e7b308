"""Placement on this machine's 2 cores: the embedded job co-located on 2 ranks (generator replicas 2,
trainer dp 2, sync; 1 thread each) against split over 3 ranks (sync and periodic), in one run, with the
planner's prediction of each; and what the reward rank of the split placement costs.

Every configuration runs `--steps` steps `--repeats` times (alternating); the first 2 steps of each
are skipped. TPSPD is the recipe's (tokens / step s / ranks); tokens/s is the whole machine's, the
fairer figure where 3 ranks share 2 cores. The planner is calibrated from the first repeat's runs
(tidal/planner/calibrate.py: the split sync run's rates, the periodic run's concurrency, the co-located
run's swap) and predicts each configuration's median step.

The reward rank: its process's CPU seconds (utime + stime from /proc, read every 50 ms while the job
runs) per step over the steps measured, beside the seconds it spent scoring (its "scored" spans).
Co-located, the reward has no process of its own: it scores on the generator's ranks between their
phases.

    .venv/bin/python bench/placement.py [--repeats 3] [--steps 20]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tidal.launch import jobs  # noqa: E402

TWO = ["generator.replicas=2", "trainer.dp=2"]
CONFIGS = {  # name -> (ranks, schedule, --set overrides)
    "co-located, 2 ranks": (2, "sync", ["placement=colocated", *TWO]),
    "split, 3 ranks": (3, "sync", []),
    "split, 3 ranks, periodic": (3, "periodic", []),
}
SKIP = 2
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def rank_pids(torchrun: int) -> dict[int, int]:
    out = {}
    for task in Path(f"/proc/{torchrun}/task").iterdir():
        for child in (task / "children").read_text().split():
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                out[rank] = int(child)
    return out


def run(out: Path, *, nproc: int, schedule: str, overrides: list[str],
        steps: int) -> tuple[list[dict], dict[int, list[tuple[float, float]]]]:
    """The job under torchrun, 1 thread per rank; -> its metrics rows and each rank's CPU seconds over
    wall-clock time, [(time.time(), CPU s)], read every 50 ms."""
    cmd = jobs.command("grpo", "--overwrite", "--schedule", schedule, steps=steps, output_dir=out, nproc=nproc,
                       overrides=["logging.samples_every=1", *overrides])
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "TIDAL_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    cpu: dict[int, list[tuple[float, float]]] = {}

    def sample() -> None:
        while proc.poll() is None:
            try:
                for rank, pid in rank_pids(proc.pid).items():
                    cpu.setdefault(rank, []).append((time.time(), cpu_seconds(pid)))
            except (FileNotFoundError, ProcessLookupError):
                pass
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate(timeout=900)
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"run failed ({cmd}):\n{err[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], cpu


def cpu_between(readings: list[tuple[float, float]], t0: float, t1: float) -> float:
    """CPU seconds used between wall times t0 and t1 (the readings nearest each)."""
    at = lambda t: min(readings, key=lambda r: abs(r[0] - t))[1]  # noqa: E731
    return at(t1) - at(t0)


def scored_s(out: Path, *, rank: int, steps: range) -> float:
    """Seconds rank `rank` spent in "scored" spans in `steps`."""
    events = [json.loads(line) for line in (out / "timeline" / f"rank{rank:03d}.jsonl").read_text().splitlines()]
    return sum(e["t1"] - e["t0"] for e in events if e["kind"] == "scored" and e["step"] in steps)


def predictions(dirs: dict[str, Path]) -> dict[str, float]:
    from tidal.planner.calibrate import calibrate, fit_concurrency, shapes_of, swap_seconds
    from tidal.planner.plan import colocated, predict

    rates = calibrate(dirs["split, 3 ranks"])
    rates = dataclasses.replace(rates, concurrency=fit_concurrency(rates, dirs["split, 3 ranks, periodic"]),
                                swap_s=swap_seconds(dirs["co-located, 2 ranks"]))
    shapes = [s for step, s in sorted(shapes_of(dirs["split, 3 ranks"]).items()) if step >= 1]
    sync, periodic, _ = predict(shapes, rates, replicas=1, dp=1)
    return {"co-located, 2 ranks": colocated(shapes, rates, devices=2).step_s, "split, 3 ranks": sync,
            "split, 3 ranks, periodic": periodic}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    rows = {name: [] for name in CONFIGS}
    reward = []  # (split reward rank's CPU s per step, its scoring s per step)
    with tempfile.TemporaryDirectory(prefix="tidal-bench-placement-") as tmp:
        first = {}
        for repeat in range(args.repeats):
            for name, (nproc, schedule, sets) in CONFIGS.items():
                out = Path(tmp) / f"{repeat}-{name.replace(' ', '_').replace(',', '')}"
                metrics, cpu = run(out, nproc=nproc, schedule=schedule, overrides=sets, steps=args.steps)
                rows[name].append(metrics[SKIP:])
                first.setdefault(name, out)
                if name == "split, 3 ranks":  # the steps after the skipped ones: start-up left out
                    t0, t1 = metrics[SKIP]["generator/gen_start_t"], metrics[-1]["trainer/push_end_t"]
                    n = args.steps - SKIP
                    reward.append((cpu_between(cpu[1], t0, t1) / n,
                                   scored_s(out, rank=1, steps=range(SKIP, args.steps)) / n))
        predicted = predictions(first)
    base = statistics.median(r["step_s"] for rs in rows["split, 3 ranks"] for r in rs)
    table = []
    for name, repeats in rows.items():
        steps = [r for rs in repeats for r in rs]
        med = statistics.median(r["step_s"] for r in steps)
        table.append([name, CONFIGS[name][0], f"{med:.3f}",
                      " ".join(f"{statistics.median(r['step_s'] for r in rs):.3f}" for rs in repeats),
                      f"{base / med:.2f}x", f"{statistics.median(r['tpspd'] for r in steps):.0f}",
                      f"{statistics.median(r['tokens'] / r['step_s'] for r in steps):.0f}", f"{predicted[name]:.3f}"])
    print(f"embedded job, {args.steps} steps x {args.repeats} repeats (first {SKIP} of each skipped), 1 thread per rank")
    print(tabulate(table, headers=["placement", "ranks", "median step s", "per repeat", "vs split sync",
                                   "TPSPD", "tokens/s", "planner step s"], disable_numparse=True))
    cpu_s, score_s = statistics.median(r[0] for r in reward), statistics.median(r[1] for r in reward)
    print(f"\nsplit: the reward rank's process used {cpu_s:.3f} CPU s per step, of which scoring {score_s:.3f} s "
          f"(median of {len(reward)} runs); co-located it has no process of its own")


if __name__ == "__main__":
    main()
