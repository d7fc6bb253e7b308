"""Multi-turn rollouts: what the turns cost, and what periodic asynchrony does with their long tail.

1. tokens/s of the embedded multi-turn job (lookup: look, read, answer) against a single-turn job of
   the same total response tokens (generator.max_new_tokens = the multi-turn responses' mean length,
   observations included), same model, prompts and batch; and the time spent in the environment.
   Each engine the running Python has (native always; vLLM under .venv-vllm/bin/python).
2. periodic vs sync on a multi-turn job whose turn counts vary by prompt (`Chain`: a prompt needs
   1 to 4 looks before its digit shows), with the placement planner's prediction of both, calibrated
   as bench/periodic_vs_sync.py does.
3. `--latency L1,L2,..`: every environment call (reset and step) made to take L s more (`Latent`, around
   the lookup task or `--env`), with the calls inline on the decode loop (multi_turn.env_workers=0:
   serial, what Tidal did before issue 45) and on the pool (the default): s/step, the share of the step
   the engine waited with nothing to decode (generator/env_wait_s), and the bound a hidden latency
   meets: the no-latency step plus (1 + turns per sample) x L, a sample's calls one after another.
   Serial runs only up to `--serial-max` s (B x G x turns x L a step past it).

    .venv/bin/python bench/multi_turn.py [--repeats 3] [--steps 6] [--part 1|2]
    .venv-vllm/bin/python bench/multi_turn.py --part 1 --engine vllm
    .venv/bin/python bench/multi_turn.py --latency 0,0.05,0.2,1.0 --repeats 1 --steps 3
    PYTHONPATH=../shared/real .venv/bin/python bench/multi_turn.py --latency 0 --env python --set model.path=DIR ...
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tidal.launch import jobs  # noqa: E402
from tidal.executors.environments.base import EnvStep  # noqa: E402
from tidal.executors.environments.lookup import Lookup  # noqa: E402

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


class Latent:
    """Any environment (env_args `inner`: a registered name or module:Class) whose every call takes
    `latency` s more: a tool's round trip (off the decode loop, where the inner one may run inline)."""

    deterministic = True
    inline = False

    def __init__(self, sample: dict, *, latency: float, inner: str = "lookup", **inner_args):
        from tidal.executors.environments.base import env_class

        self.latency = latency
        self.env = env_class(inner)(sample, **inner_args)

    def reset(self):
        time.sleep(self.latency)
        return self.env.reset()

    def step(self, turn) -> EnvStep:
        time.sleep(self.latency)
        return self.env.step(turn)


def part3(args, tmp: Path) -> None:
    latencies = [float(x) for x in args.latency.split(",")]
    base = [*MULTI_TURN, "multi_turn.env=bench.multi_turn:Latent", *args.set]
    inner = {"inner": args.env} if args.env else {}
    runs: dict[tuple[float, str], list[dict]] = {}
    for r in range(args.repeats):
        for L in latencies:
            for mode, workers in (("serial", 0), ("pool", None)):
                if mode == "serial" and L > args.serial_max:
                    continue
                env_args = json.dumps({"latency": L, **inner})
                extra = [f"multi_turn.env_args={env_args}"] + ([f"multi_turn.env_workers={workers}"]
                                                               if workers is not None else [])
                rows = jobs.run("grpo", "--overwrite", "--schedule", args.schedule, output_dir=tmp / f"{r}-{L}-{mode}",
                                steps=args.steps, overrides=[*base, *extra], nproc=3).metrics
                runs.setdefault((L, mode), []).append(
                    {"step_s": med(rows, lambda x: x["step_s"]), "gen_s": med(rows, lambda x: x["generator/gen_s"]),
                     "wait": med(rows, lambda x: x["generator/env_wait_s"] / x["step_s"]),
                     "turns": med(rows, lambda x: x["generator/turns_mean"]),
                     "digests": [x["trainer/rollout_digest"] for x in rows]})
                print(f"L={L} {mode} (repeat {r + 1}): {runs[(L, mode)][-1]['step_s']:.2f} s/step", flush=True)
    fig = {k: {m: statistics.median(v[m] for v in vs) for m in ("step_s", "gen_s", "wait", "turns")}
           for k, vs in runs.items()}
    zero = fig.get((0.0, "pool"))
    reference = runs.get((0.0, "serial"))  # the rollouts of inline calls without latency, per repeat

    def same(key) -> str:
        if reference is None:
            return "-"
        return f"{sum(a['digests'] == b['digests'] for a, b in zip(runs[key], reference))}/{len(reference)}"
    table = []
    for L in latencies:
        pool, serial = fig[(L, "pool")], fig.get((L, "serial"))
        bound = zero["step_s"] + (1 + pool["turns"]) * L if zero else float("nan")
        table.append([L, f"{serial['step_s']:.2f}" if serial else "-", f"{serial['wait']:.0%}" if serial else "-",
                      pool["step_s"], f"{pool['wait']:.0%}", f"{serial['step_s'] / pool['step_s']:.1f}" if serial else "-",
                      bound, "yes" if pool["step_s"] <= bound else "no", pool["turns"], same((L, "pool"))])
    print(f"\npart 3: tool latency, {args.schedule}, medians of {args.repeats} run(s) x {args.steps - 1} steps "
          f"(step 0 left out); env idle: the share of the step the engine waited for the environment")
    print(tabulate(table, floatfmt=".2f", headers=[
        "latency s", "serial s/step", "serial env idle", "pool s/step", "pool env idle", "speed-up", "bound s",
        "within", "turns/sample", "rollouts = serial at 0"]))


def med(rows: list[dict], key) -> float:
    return statistics.median(key(r) for r in rows[1:])  # step 0 warms up


def part1(args, tmp: Path) -> None:
    engine = [f"generator.engine={args.engine}"]
    table = []
    mt_tps, st_tps, env_s, mt_gen, st_gen, lengths = [], [], [], [], [], []
    for i in range(args.repeats):
        mt = jobs.run("grpo", "--overwrite", "--schedule", "sync", output_dir=tmp / "mt",
                      steps=args.steps, overrides=[*MULTI_TURN, *engine], nproc=3).metrics
        length = round(med(mt, lambda r: r["trainer/response_len_mean"]))
        st = jobs.run("grpo", "--overwrite", "--schedule", "sync", output_dir=tmp / "st",
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
    from tidal.planner.calibrate import calibrate, fit_concurrency
    from tidal.planner.plan import predict
    from tidal.planner.calibrate import shapes_of

    chain = [*MULTI_TURN, "multi_turn.env=bench.multi_turn:Chain", "multi_turn.max_turns=6"]
    cal_cfgs = [["generator.max_new_tokens=8", "generator.max_batch_prompts=1", "data.prompts_per_step=16"],
                ["generator.max_new_tokens=64", "generator.max_batch_prompts=4", "data.prompts_per_step=16"],
                ["generator.max_new_tokens=32", "generator.samples_per_prompt=8", "generator.max_batch_prompts=4"]]
    cal = []
    for i, overrides in enumerate(cal_cfgs):
        jobs.run("grpo", "--overwrite", "--schedule", "sync", output_dir=tmp / f"cal-{i}",
                 steps=args.steps, overrides=["logging.samples_every=1", *overrides], nproc=3)
        cal.append(tmp / f"cal-{i}")
    jobs.run("grpo", "--overwrite", "--schedule", "periodic", output_dir=tmp / "cal-periodic",
             steps=args.steps, overrides=["logging.samples_every=1", *cal_cfgs[-1]], nproc=3)
    rates = calibrate(*cal)
    rates = dataclasses.replace(rates, concurrency=fit_concurrency(rates, tmp / "cal-periodic"))
    sync_s, per_s, pred_s, pred_p, turns, same = [], [], [], [], [], True
    for i in range(args.repeats):
        s = jobs.run("grpo", "--overwrite", "--schedule", "sync", output_dir=tmp / "sync",
                     steps=args.steps, overrides=chain, nproc=3).metrics
        shapes = [shape for step, shape in sorted(shapes_of(tmp / "sync").items()) if step >= 1]
        ps, pp, _ = predict(shapes, rates, replicas=1, dp=1)
        q = jobs.run("grpo", "--overwrite", "--schedule", "periodic", output_dir=tmp / "periodic",
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
    p.add_argument("--latency", help="part 3: comma-separated tool latencies in seconds")
    p.add_argument("--serial-max", type=float, default=0.2, help="part 3: the largest latency run serially too")
    p.add_argument("--schedule", default="sync", help="part 3: the schedule")
    p.add_argument("--env", help="part 3: the environment under the latency (default: the lookup task)")
    p.add_argument("--set", action="append", default=[], help="part 3: more overrides (KEY=VALUE)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        if args.latency:
            return part3(args, Path(tmp_dir))
        if args.part in (None, 1):
            part1(args, Path(tmp_dir))
        if args.part in (None, 2):
            part2(args, Path(tmp_dir))


if __name__ == "__main__":
    main()
