"""`launch.py --algo NAME --plan [--devices N]`: every split of N devices between the generator
and the trainer, with the model's sync and periodic step time and TPSPD, the offpolicy (max_lag=1)
step time beside them (what staying on-policy costs), and the split to use; then,
for that split, the generator's admission (groups decoded at once) that the model's periodic step
is fastest with.

Rates come from a calibration on this machine (two short runs of the configured job, tidal/planner/
calibrate.py) or from a YAML file (`--rates FILE`, e.g. configs/plan-qwen3-8b-16npu.yaml). A replica
keeps its calibrated rates at any count and a trainer unit its own, so a split's generator runs
replicas = devices // generator.tp engines side by side and its trainer dp = devices // (trainer.tp x
trainer.pp) units (a unit's pipeline stages and their bubble are in its calibrated rate); all-reduce and push costs are taken as measured (they grow with dp in a real job).
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from tabulate import tabulate

from tidal.executors.generator.engines import DEFAULT_ADMISSION, ENGINES
from tidal.planner.model import GenRates, Rates, StepShape, TrainRates, simulate, simulate_offpolicy


@dataclass(frozen=True, kw_only=True)
class Split:
    gen_devices: int
    train_devices: int
    replicas: int
    dp: int
    sync_s: float
    periodic_s: float
    offpolicy_s: float  # schedule offpolicy, max_lag=1: what on-policy costs on this split
    tokens: float

    def tpspd(self, step_s: float, devices: int) -> float:
        return self.tokens / step_s / devices


def predict(shapes: list[StepShape], rates: Rates, *, replicas: int, dp: int) -> tuple[float, float, float]:
    """Median sync and periodic step time and mean tokens over the given steps, laid out anew."""
    laid = [replace(s, replicas=replicas, dp=dp) for s in shapes]
    sync = statistics.median(simulate(s, rates, schedule="sync").step_s for s in laid)
    periodic = statistics.median(simulate(s, rates, schedule="periodic").step_s for s in laid)
    return sync, periodic, statistics.mean(s.tokens for s in laid)


def predict_offpolicy(shapes: list[StepShape], rates: Rates, *, max_lag: int, replicas: int, dp: int,
                      steps: int = 8) -> float:
    """Median step time of `steps` consecutive offpolicy steps (the given shapes cycled), the first
    (filling the pipeline) left out."""
    laid = [replace(shapes[i % len(shapes)], replicas=replicas, dp=dp) for i in range(steps)]
    return statistics.median(simulate_offpolicy(laid, rates, max_lag=max_lag)[1:])


@dataclass(frozen=True, kw_only=True)
class Colocated:
    """placement=colocated on all the devices: generation, the memory swap, then training, in turn."""
    devices: int
    replicas: int
    dp: int
    step_s: float
    tokens: float

    def tpspd(self, devices: int) -> float:
        return self.tokens / self.step_s / devices


def colocated(shapes: list[StepShape], rates: Rates, *, devices: int, gen_tp: int = 1,
              train_unit: int = 1) -> Colocated | None:
    """Every device holds a generator replica's and a trainer unit's share: the sync step with
    replicas = devices / gen_tp and dp = devices / train_unit, plus the swap. The push is taken at its
    split cost (a co-located one is partly a local copy: an upper bound). None: the devices do not
    divide into whole units."""
    if devices % gen_tp or devices % train_unit:
        return None
    replicas, dp = devices // gen_tp, devices // train_unit
    if dp > len(shapes[0].lengths) or replicas > len(shapes[0].lengths):
        return None
    laid = [replace(s, replicas=replicas, dp=dp) for s in shapes]
    step = statistics.median(simulate(s, rates, schedule="sync").step_s for s in laid) + rates.swap_s
    return Colocated(devices=devices, replicas=replicas, dp=dp, step_s=step,
                     tokens=statistics.mean(s.tokens for s in laid))


def splits(shapes: list[StepShape], rates: Rates, *, devices: int, gen_tp: int = 1, train_unit: int = 1,
           other_devices: int = 0) -> list[Split]:
    """Every split of `devices` (less other_devices, e.g. reward ranks on their own devices) into whole
    generator replicas and trainer units; none when no split has both."""
    out, free = [], devices - other_devices
    for g in range(gen_tp, free, gen_tp):
        t = (free - g) // train_unit * train_unit
        if t < train_unit:
            continue
        replicas, dp = g // gen_tp, t // train_unit
        if dp > len(shapes[0].lengths) or replicas > len(shapes[0].lengths):
            continue  # more units than groups: some would get none
        sync, periodic, tokens = predict(shapes, rates, replicas=replicas, dp=dp)
        offpolicy = predict_offpolicy(shapes, rates, max_lag=1, replicas=replicas, dp=dp)
        out.append(Split(gen_devices=g, train_devices=t, replicas=replicas, dp=dp, sync_s=sync, periodic_s=periodic,
                         offpolicy_s=offpolicy, tokens=tokens))
    return out


def table(rows: list[Split], *, devices: int, together: Colocated | None = None) -> str:
    """Every split, then the co-located placement (sync only: its periodic and offpolicy columns are
    empty); the best TPSPD (split: periodic; co-located: sync) marked."""
    if not rows and together is None:
        return "no split of the devices gives both the generator and the trainer a whole unit"
    best = best_placement(rows, together, devices=devices)
    body = [[r.gen_devices, r.train_devices, r.replicas, r.dp, r.sync_s, r.periodic_s, r.sync_s / r.periodic_s,
             r.tpspd(r.sync_s, devices), r.tpspd(r.periodic_s, devices), r.offpolicy_s, "<- use" if r is best else ""]
            for r in rows]
    if together is not None:
        c = together
        body.append([f"{c.devices} (co-located)", c.devices, c.replicas, c.dp, c.step_s, "", "", c.tpspd(devices),
                     "", "", "<- use" if c is best else ""])
    return tabulate(body, floatfmt=(".0f", ".0f", ".0f", ".0f", ".3g", ".3g", ".2f", ".4g", ".4g", ".3g", ""), headers=[
        "generator devices", "trainer devices", "replicas", "trainer dp", "sync step s", "periodic step s",
        "periodic speed-up", "TPSPD sync", "TPSPD periodic", "offpolicy k=1 step s", ""])


def best_placement(rows: list[Split], together: Colocated | None, *, devices: int) -> Split | Colocated:
    """The split with the best periodic TPSPD, or the co-located placement where its sync TPSPD is higher."""
    best = best_split(rows, devices=devices) if rows else None
    if together is not None and (best is None or together.tpspd(devices) > best.tpspd(best.periodic_s, devices)):
        return together
    return best


@dataclass(frozen=True, kw_only=True)
class Slots:
    """One admission setting of the generator: max_batch_prompts (vLLM: max_num_seqs / G)."""
    slots: int
    periodic_s: float
    overlap_s: float


def slot_choices(shapes: list[StepShape], rates: Rates, *, replicas: int, dp: int) -> list[Slots]:
    """The periodic step at 1, 2, 4, ... slots up to a replica's whole share of the step (and the
    slots the job ran with): fewer slots make waves whose first lets the trainer start early, more
    take fewer forwards; which wins depends on the rates (docs/running.md, reading overlap_s)."""
    per_replica = -(-len(shapes[0].lengths) // replicas)
    values = {min(shapes[0].max_batch_prompts, per_replica), per_replica}
    values |= {1 << k for k in range(per_replica.bit_length()) if 1 << k <= per_replica}
    out = []
    for n in sorted(values):
        laid = [replace(s, max_batch_prompts=n, replicas=replicas, dp=dp) for s in shapes]
        runs = [simulate(s, rates, schedule="periodic") for s in laid]
        out.append(Slots(slots=n, periodic_s=statistics.median(r.step_s for r in runs),
                         overlap_s=statistics.median(r.overlap_s for r in runs)))
    return out


def best_split(rows: list[Split], *, devices: int) -> Split:
    return max(rows, key=lambda r: r.tpspd(r.periodic_s, devices))


def slots_table(shapes: list[StepShape], rates: Rates, split: Split, *, samples: int, engine: str = "native") -> str:
    """The admission settings for `split`, the fastest periodic one marked, as the --set to use."""
    rows = slot_choices(shapes, rates, replicas=split.replicas, dp=split.dp)
    best = min(rows, key=lambda r: r.periodic_s)
    key, value = ENGINES.get(engine).slots_setting(best.slots, samples=samples)
    body = [[r.slots, r.slots * samples, r.periodic_s, r.overlap_s, "<- use" if r is best else ""] for r in rows]
    return (f"generator admission for {split.gen_devices} generator / {split.train_devices} trainer devices "
            f"(periodic): --set {key}={value}, predicted {best.periodic_s:.3g} s/step\n"
            + tabulate(body, floatfmt=(".0f", ".0f", ".3g", ".3g", ""), headers=[
                "groups at once", "sample rows", "periodic step s", "overlap s", ""]))


def partial_table(shapes: list[StepShape], rates: Rates, split: Split, *, budgets: list[int]) -> str:
    """Periodic on `split` with whole rollouts and with each partial-rollout budget (tidal/planner/partial.py):
    what a step trains and how stale it is; the budget that trains the most tokens a second marked."""
    from tidal.planner.partial import budget_rows

    laid = [replace(s, replicas=split.replicas, dp=split.dp) for s in shapes]
    rows = budget_rows(laid, rates, budgets=budgets)
    best = max(rows, key=lambda r: r.tokens_per_s)
    use = "whole rollouts" if best.budget is None else f"--set generator.partial_rollout_tokens={best.budget}"
    body = [["whole" if r.budget is None else r.budget, r.step_s, r.groups, r.tokens_per_s,
             r.tokens_per_s / rows[0].tokens_per_s, r.staleness_mean, "<- use" if r is best else ""] for r in rows]
    return (f"partial rollouts for {split.gen_devices} generator / {split.train_devices} trainer devices (periodic, "
            f"the steps' lengths): {use}\n"
            + tabulate(body, floatfmt=("", ".3g", ".3g", ".4g", ".2f", ".2f", ""), headers=[
                "tokens a sample writes a step", "step s", "groups trained", "trained tokens/s", "vs whole",
                "staleness", ""]))


def load_rates(path: Path) -> tuple[Rates, list[StepShape], dict]:
    """A rates file: rates (gen, train, reward_group_s, handoff_s, concurrency, swap_s), step (prompts,
    samples, prompt_len, lengths: one list of response lengths cycled over the samples,
    max_batch_prompts, admission) and layout (devices, gen_tp, train_tp, train_pp, other_devices, engine: native
    or vllm)."""
    if not Path(path).is_file():
        raise ValueError(f"rates file {path} does not exist")
    data = yaml.safe_load(Path(path).read_text())
    try:
        r, s = data["rates"], data["step"]
        rates = Rates(gen=GenRates(**r["gen"]), train=TrainRates(**r["train"]),
                      **{k: r[k] for k in ("reward_group_s", "handoff_s", "concurrency", "swap_s") if k in r})
        lengths, G = list(s["lengths"]), s["samples"]
        per_prompt = tuple(tuple(lengths[(i * G + j) % len(lengths)] for j in range(G)) for i in range(s["prompts"]))
        shape = StepShape(prompt_lens=(s["prompt_len"],) * s["prompts"], lengths=per_prompt,
                          max_batch_prompts=s["max_batch_prompts"], admission=s.get("admission", DEFAULT_ADMISSION),
                          shared_prompt=s.get("shared_prompt", True))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"rates file {path}: missing or malformed {exc}") from None
    return rates, [shape], data.get("layout", {})


def calibration_runs(argv: list[str], out: Path, *, run, ranks: dict[str, int], steps: int = 5,
                     colocated: tuple[str, ...] = ()) -> tuple[Path, ...]:
    """Run the configured job on this machine (sync: the rates; periodic: how much the executors slow
    each other when they overlap), `steps` steps each, the first warming up; with `colocated` (the
    --set layout it needs) a third, co-located, for the swap's cost. run(launch.py's args, nproc) ->
    (exit code, stderr); ranks: each run's world size."""
    split = ("--set", "placement=split")  # not the launch's choice (tidal/launch/auto.py): the placement is what is measured
    runs = [("sync", split), ("periodic", split)] + ([("colocated", ("--set", "placement=colocated", *colocated))]
                                                     if colocated else [])
    dirs = []
    for name, extra in runs:
        d = out / name
        args = [*argv, "--steps", str(steps), "--schedule", "sync" if name == "colocated" else name,
                "--output-dir", str(d), "--overwrite", "--set", "logging.samples_every=1", "--set", "checkpoint_every=0",
                "--set", "checkpoint_minutes=0",
                # whole rollouts: a group's lengths and its leave time then belong to one step (partial.py predicts cuts)
                "--set", "generator.partial_rollout_tokens=null", *extra]
        print(f"tidal plan: calibration run ({name}, {steps} steps)", file=sys.stderr, flush=True)
        code, err = run(args, ranks[name])
        if code:
            raise ValueError(f"calibration run ({name}) failed:\n{err[-2000:]}")
        dirs.append(d)
    return tuple(dirs)


def colocated_layout(*, gen_tp: int, train_unit: int) -> tuple[str, ...]:
    """The smallest co-located layout of these tp sizes: lcm(gen_tp, train_unit) ranks."""
    ranks = math.lcm(gen_tp, train_unit)
    return ("--set", f"generator.replicas={ranks // gen_tp}", "--set", f"trainer.dp={ranks // train_unit}")


def plan_here(argv: list[str], *, run, devices: int, gen_tp: int, train_unit: int, split_ranks: int,
              partial: int | None = None) -> str:
    """run: how a calibration run is run (calibration_runs); split_ranks: the job's world size placed split.
    partial: the job's generator.partial_rollout_tokens (calibrated on whole rollouts, then predicted)."""
    from tidal.planner.calibrate import calibrate, fit_concurrency, shapes_of, swap_seconds

    ranks = {"sync": split_ranks, "periodic": split_ranks, "colocated": math.lcm(gen_tp, train_unit)}
    with tempfile.TemporaryDirectory(prefix="tidal-plan-") as tmp:
        sync_dir, periodic_dir, colocated_dir = calibration_runs(
            argv, Path(tmp), run=run, ranks=ranks, colocated=colocated_layout(gen_tp=gen_tp, train_unit=train_unit))
        rates = calibrate(sync_dir)
        rates = replace(rates, concurrency=fit_concurrency(rates, periodic_dir), swap_s=swap_seconds(colocated_dir))
        shapes = [s for step, s in sorted(shapes_of(sync_dir).items()) if step >= 1]
        gen = json.loads((sync_dir / "config.json").read_text())["generator"]
    # per-term rates are not all identifiable from one job's shape; what the model makes of it is
    steps = [simulate(s, rates, schedule="sync") for s in shapes]
    head = (f"calibrated on this machine (sync, as run): generation "
            f"{statistics.median(p.gen_s for p in steps):.3g} s, training "
            f"{statistics.median(p.train_end_s - p.first_train_s for p in steps):.3g} s, barrier+push "
            f"{rates.train.barrier_s + rates.train.push_s:.3g} s per step; executors keep "
            f"{rates.concurrency:.2f} of their speed while overlapping; co-located, the memory moves take "
            f"{rates.swap_s:.3g} s per step")
    rows = splits(shapes, rates, devices=devices, gen_tp=gen_tp, train_unit=train_unit)
    together = colocated(shapes, rates, devices=devices, gen_tp=gen_tp, train_unit=train_unit)
    text = head + "\n" + table(rows, devices=devices, together=together)
    if rows:
        text += "\n\n" + slots_table(shapes, rates, best_split(rows, devices=devices),
                                      samples=gen["samples_per_prompt"], engine=gen.get("engine", "native"))
        text += "\n\n" + partial_table(shapes, rates, best_split(rows, devices=devices),
                                        budgets=budgets(gen["max_new_tokens"], asked=partial))
    return text


def budgets(max_new_tokens: int, *, asked: int | None) -> list[int]:
    """The partial-rollout budgets --plan compares: the job's own, and a half, a quarter and an eighth of the cap."""
    return sorted({n for n in (asked, max_new_tokens // 2, max_new_tokens // 4, max_new_tokens // 8) if n})


def trainer_unit(layout: dict) -> int:
    """The devices of one trainer unit in a rates file's layout: tp x pp (trainer.pp: its pipeline stages)."""
    return layout.get("train_tp", 1) * layout.get("train_pp", 1)


def plan_from_file(path: Path, *, devices: int | None) -> str:
    rates, shapes, layout = load_rates(path)
    n = devices or layout.get("devices")
    if not n:
        raise ValueError(f"--plan --rates {path}: give --devices N (the file names no layout.devices)")
    tps = dict(gen_tp=layout.get("gen_tp", 1), train_unit=trainer_unit(layout))
    rows = splits(shapes, rates, devices=n, other_devices=layout.get("other_devices", 0), **tps)
    text = table(rows, devices=n, together=colocated(shapes, rates, devices=n, **tps))
    if not rows:
        return text
    longest = max(n for s in shapes for lengths in s.lengths for n in lengths)
    return (text + "\n\n" + slots_table(shapes, rates, best_split(rows, devices=n), samples=len(shapes[0].lengths[0]),
                                        engine=layout.get("engine", "native"))
            + "\n\n" + partial_table(shapes, rates, best_split(rows, devices=n), budgets=budgets(longest, asked=None)))
