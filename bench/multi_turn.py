"""Multi-turn rollouts: what the turns cost, and what periodic asynchrony does with their long tail.

1. tokens/s of the embedded multi-turn job (lookup: look, read, answer) against a single-turn job of
   the same total response tokens (generator.max_new_tokens = the multi-turn responses' mean length,
   observations included), same model, prompts and batch; and the time spent in the environment.
   Each engine the running Python has (native always; vLLM under .venv-vllm/bin/python).
2. periodic vs sync on a multi-turn job whose turn counts vary by prompt (`Chain`: a prompt needs
   1 to 4 looks before its digit shows), with the placement planner's prediction of both, calibrated
   as bench/periodic_vs_sync.py does.

    .venv/bin/python bench/multi_turn.py [--repeats 3] [--steps 6] [--part 1|2]
    .venv-vllm/bin/python bench/multi_turn.py --part 1 --engine vllm
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
from launch import jobs  # noqa: E402
from executors.environments.base import EnvStep  # noqa: E402
from executors.environments.lookup import Lookup  # noqa: E402

MULTI_TURN = ["rollout=multi_turn", "logging.samples_every=1"]


class Chain(Lookup):
    """The lookup task with a long tail of turns: the digit shows only at look number 1 + (a hash of
    the prompt) % 4, earlier looks answer "not yet"; deterministic, so sync and periodic agree."""

    def __init__(self, sample: dict):
        super().__init__(sample)
        self.needed, self.looks = 1 + sum(map(ord, self.reveal)) % 4, 0

    def step(self, turn) -> EnvStep:
        if any(c in "0123456789" for c in turn.text):
            return EnvStep(done=True)
        self.looks += 1
        return EnvStep(observation=" " + self.reveal if self.looks >= self.needed else " not yet .")


def med(rows: list[dict], key) -> float:
    return statistics.median(key(r) for r in rows[1:])  # step 0 warms up


def part1(args, tmp: Path) -> None:
    engine = [f"generator.engine={args.engine}"]
    table = []
    mt_tps, st_tps, env_s, mt_gen, st_gen, lengths = [], [], [], [], [], []
    for i in range(args.repeats):
        mt = jobs.run("grpo", "--schedule", "sync", output_dir=tmp / "mt",
                      steps=args.steps, overrides=[*MULTI_TURN, *engine], nproc=3).metrics
        length = round(med(mt, lambda r: r["trainer/response_len_mean"]))
        st = jobs.run("grpo", "--schedule", "sync", output_dir=tmp / "st",
                      steps=args.steps, overrides=[f"generator.max_new_tokens={length}", *engine,
                                                             "logging.samples_every=1"], nproc=3).metrics
        # response tokens (model turns and observations) per second of generation
        mt_tps.append(med(mt, lambda r: r["trainer/response_len_mean"] * r["trainer/groups"] * 16 / r["generator/gen_s"]))
        st_tps.append(med(st, lambda r: r["trainer/response_len_mean"] * r["trainer/groups"] * 16 / r["generator/gen_s"]))
        env_s.append(med(mt, lambda r: r["generator/env_s"]))
        mt_gen.append(med(mt, lambda r: r["generator/gen_s"]))
        st_gen.append(med(st, lambda r: r["generator/gen_s"]))
        lengths.append(length)
    m = {k: statistics.median(v) for k, v in dict(mt=mt_tps, st=st_tps, env=env_s, mg=mt_gen, sg=st_gen).items()}
    table.append([args.engine, statistics.median(lengths), m["st"], m["mt"], m["mt"] / m["st"], m["sg"], m["mg"], m["env"],
                  m["env"] / m["mg"]])
    print(f"part 1: the embedded job, B=8 x G=16, sync, medians of {args.repeats} runs x {args.steps - 1} steps")
    print(tabulate(table, floatfmt=".3f", headers=[
        "engine", "response tokens", "single-turn tok/s", "multi-turn tok/s", "ratio", "single gen s", "multi gen s",
        "env s", "env share"]))


def part2(args, tmp: Path) -> None:
    from planner.calibrate import calibrate, fit_concurrency
    from planner.plan import predict
    from planner.calibrate import shapes_of

    chain = [*MULTI_TURN, "multi_turn.env=bench.multi_turn:Chain", "multi_turn.max_turns=6"]
    cal_cfgs = [["generator.max_new_tokens=8", "generator.max_batch_prompts=1", "data.prompts_per_step=16"],
                ["generator.max_new_tokens=64", "generator.max_batch_prompts=4", "data.prompts_per_step=16"],
                ["generator.max_new_tokens=32", "generator.samples_per_prompt=8", "generator.max_batch_prompts=4"]]
    cal = []
    for i, overrides in enumerate(cal_cfgs):
        jobs.run("grpo", "--schedule", "sync", output_dir=tmp / f"cal-{i}",
                 steps=args.steps, overrides=["logging.samples_every=1", *overrides], nproc=3)
        cal.append(tmp / f"cal-{i}")
    jobs.run("grpo", "--schedule", "periodic", output_dir=tmp / "cal-periodic",
             steps=args.steps, overrides=["logging.samples_every=1", *cal_cfgs[-1]], nproc=3)
    rates = calibrate(*cal)
    rates = dataclasses.replace(rates, concurrency=fit_concurrency(rates, tmp / "cal-periodic"))
    sync_s, per_s, pred_s, pred_p, turns, same = [], [], [], [], [], True
    for i in range(args.repeats):
        s = jobs.run("grpo", "--schedule", "sync", output_dir=tmp / "sync",
                     steps=args.steps, overrides=chain, nproc=3).metrics
        shapes = [shape for step, shape in sorted(shapes_of(tmp / "sync").items()) if step >= 1]
        ps, pp, _ = predict(shapes, rates, replicas=1, dp=1)
        q = jobs.run("grpo", "--schedule", "periodic", output_dir=tmp / "periodic",
                     steps=args.steps, overrides=chain, nproc=3).metrics
        same &= [r["trainer/rollout_digest"] for r in s] == [r["trainer/rollout_digest"] for r in q]
        sync_s.append(med(s, lambda r: r["step_s"]))
        per_s.append(med(q, lambda r: r["step_s"]))
        pred_s.append(ps)
        pred_p.append(pp)
        turns.append(med(s, lambda r: r["generator/turns_mean"]))
    ms, mp, qs, qp = (statistics.median(x) for x in (sync_s, per_s, pred_s, pred_p))
    print(f"part 2: multi-turn with 1-4 looks per prompt (Chain), medians of {args.repeats} runs x {args.steps - 1} steps")
    print(tabulate([[statistics.median(turns), ms, qs, f"{(qs / ms - 1) * 100:+.0f}%", mp, qp, f"{(qp / mp - 1) * 100:+.0f}%",
                     ms / mp, "yes" if same else "NO"]], floatfmt=".3f", headers=[
        "turns/sample", "sync s", "predicted", "error", "periodic s", "predicted", "error", "speed-up", "same rollouts"]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--part", type=int, choices=(1, 2))
    p.add_argument("--engine", default="native", choices=("native", "vllm"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        if args.part in (None, 1):
            part1(args, Path(tmp_dir))
        if args.part in (None, 2):
            part2(args, Path(tmp_dir))


if __name__ == "__main__":
    main()
