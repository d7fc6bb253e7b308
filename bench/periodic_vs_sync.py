"""Periodic asynchrony vs the synchronous schedule, same job, same seed, one invocation.

For each config: run `sync` and `periodic` (3 repeats each, alternating), skip the first step
(warm-up), and take medians. From the sync runs: T_gen (generation) and T_train (training + barrier
+ push); the ideal speed-up of overlapping them is (T_gen + T_train) / max(T_gen, T_train). The
measured speed-up is sync step_s / periodic step_s; efficiency = measured / bound.

    .venv/bin/python bench/periodic_vs_sync.py [--repeats 3] [--steps 6]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from controller.spawn import free_port  # noqa: E402

# generator and trainer on one core each (reward is light); sizes chosen so that in the
# balanced config generation and training take similar time on this CPU
CONFIGS = {
    "balanced": ["generator.max_new_tokens=32", "generator.max_batch_prompts=2", "data.prompts_per_step=16"],
    "gen 3x train": ["generator.max_new_tokens=160", "generator.max_batch_prompts=2", "data.prompts_per_step=16"],
}


def run(overrides: list[str], schedule: str, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3", f"--master-port={free_port()}",
               "launch.py", "--algo", "grpo", "--steps", str(steps), "--schedule", schedule, "--output-dir", out]
        for o in overrides:
            cmd += ["--set", o]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise SystemExit(f"run failed ({schedule}):\n{proc.stderr[-3000:]}")
        return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _matmuls(queue) -> None:
    import time

    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(2000):
        a @ a
    queue.put(time.perf_counter() - t0)


def concurrency() -> float:
    """How much of its solo speed each of two concurrent single-thread processes keeps (1.0 = two
    independent cores). Overlap can only pay off as far as the hardware runs two executors at once."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    solo_p = ctx.Process(target=_matmuls, args=(queue,))
    solo_p.start(), solo_p.join()
    solo = queue.get()
    pair = [ctx.Process(target=_matmuls, args=(queue,)) for _ in range(2)]
    [p.start() for p in pair], [p.join() for p in pair]
    return solo / max(queue.get(), queue.get())


def med(rows: list[dict], key) -> float:
    return statistics.median(key(r) for r in rows[1:])  # step 0 warms up


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--only", choices=list(CONFIGS), help="run one config")
    args = p.parse_args()
    table, par = [], concurrency()
    for name, overrides in CONFIGS.items():
        if args.only and name != args.only:
            continue
        sync_step, per_step, t_gen, t_train, digests_equal = [], [], [], [], True
        for _ in range(args.repeats):
            s = run(overrides, "sync", args.steps)
            q = run(overrides, "periodic", args.steps)
            digests_equal &= [r["rollout_digest"] for r in s] == [r["rollout_digest"] for r in q]
            sync_step.append(med(s, lambda r: r["step_s"]))
            per_step.append(med(q, lambda r: r["step_s"]))
            t_gen.append(med(s, lambda r: r["gen_s"]))
            t_train.append(med(s, lambda r: r["train_s"] + r["push_s"]))
        tg, tt = statistics.median(t_gen), statistics.median(t_train)
        bound = (tg + tt) / max(tg, tt)
        # with both executors busy each runs at `par` of its solo speed: overlapped work takes at
        # least (tg + tt) / (2 * par), so the speed-up this hardware allows is capped below `bound`
        hw_bound = (tg + tt) / max(tg, tt, (tg + tt) / (2 * par))
        speedup = statistics.median(sync_step) / statistics.median(per_step)
        table.append([name, tg, tt, statistics.median(sync_step), statistics.median(per_step), bound, speedup,
                      speedup / bound, hw_bound, speedup / hw_bound, "yes" if digests_equal else "NO"])
    print(f"two concurrent single-thread processes each keep {par:.2f} of their solo speed on this machine")
    print(tabulate(table, floatfmt=".3f", headers=[
        "config", "T_gen s", "T_train s", "sync step s", "periodic step s", "bound", "speed-up", "efficiency",
        "hw bound", "vs hw bound", "same rollouts"]))


if __name__ == "__main__":
    main()
