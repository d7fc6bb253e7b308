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
from tests.dist import free_port  # noqa: E402

# generator and trainer on one core each (reward is light); sizes chosen so that in the
# balanced config generation and training take similar time on this CPU
CONFIGS = {
    "balanced": ["generator.max_new_tokens=12", "generator.max_batch_prompts=4", "data.prompts_per_step=16"],
    "gen 3x train": ["generator.max_new_tokens=40", "generator.max_batch_prompts=4", "data.prompts_per_step=16",
                     "trainer.micro_batch_size=8"],
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


def med(rows: list[dict], key) -> float:
    return statistics.median(key(r) for r in rows[1:])  # step 0 warms up


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    table = []
    for name, overrides in CONFIGS.items():
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
        speedup = statistics.median(sync_step) / statistics.median(per_step)
        table.append([name, tg, tt, statistics.median(sync_step), statistics.median(per_step), bound, speedup,
                      speedup / bound, "yes" if digests_equal else "NO"])
    print(tabulate(table, floatfmt=".3f", headers=[
        "config", "T_gen s", "T_train s", "sync step s", "periodic step s", "bound", "speed-up", "efficiency",
        "same rollouts"]))


if __name__ == "__main__":
    main()
