"""Rates from a run's own records: timeline/rank*.jsonl, samples.jsonl, metrics.jsonl, config.json.

A sync run is the cleanest source (generation and training never share the hardware):
  generator  least squares of each group's leave time (its "generated" mark, from the start of the
             step's "generate" span) on the work the engine replay says was done by then (FITTED)
  trainer    least squares of the time each group took (from the previous "train" span's end, so
             receiving is included) on its samples and tokens
  barrier    from the last group's end to the push; push: the "push" span
  reward     the median "scored" span; handoff: what is left of the last group's way to the trainer
Step 0 warms up and is skipped. Response lengths come from samples.jsonl, prompt lengths from the
trainer's token count (tokens - response tokens, spread evenly over the step's prompts).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from tidal.executors.generator.engines import DEFAULT_ADMISSION, ENGINES
from tidal.planner.model import GenFeatures, GenRates, Rates, StepShape, TrainRates, simulate

# the generator terms a calibration fits (GenRates field <- GenFeatures field). A prefill counts as
# one more forward; its prompt-token term is too small to tell from noise at calibration sizes
# (fitted, it took the time of the forwards), and a rates file may give it for long prompts.
FITTED = {"forward_s": "forwards", "row_s": "rows", "row_col_s": "row_cols", "send_s": "sends",
          "join_cell_s": "join_cells"}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def shapes_of(run_dir: Path) -> dict[int, StepShape]:
    cfg = json.loads((run_dir / "config.json").read_text())
    gen, trainer = cfg["generator"], cfg["trainer"]
    lengths: dict[int, dict[int, dict[int, int]]] = collections.defaultdict(lambda: collections.defaultdict(dict))
    for s in _lines(run_dir / "samples.jsonl"):
        lengths[s["step"]][s["prompt_index"]][s["sample"]] = s["length"]
    tokens = {row["step"]: row["trainer/tokens"] for row in _lines(run_dir / "metrics.jsonl")}
    shared = trainer.get("shared_prompt", "auto") != "off"
    engine = ENGINES.get(gen.get("engine", "native"))  # vLLM: max_num_seqs sample rows, taken as whole groups
    slots, admission = engine.slots(gen), engine.admission or gen.get("admission", DEFAULT_ADMISSION)
    shapes = {}
    for step, groups in lengths.items():
        if step not in tokens:
            continue
        per_group = [tuple(groups[i][j] for j in sorted(groups[i])) for i in sorted(groups)]
        response = sum(map(sum, per_group))
        prompts = len(per_group) * (1 if shared else len(per_group[0]))
        prompt_len = max(1, round((tokens[step] - response) / prompts))
        shapes[step] = StepShape(prompt_lens=(prompt_len,) * len(per_group), lengths=tuple(per_group),
                                 max_batch_prompts=slots, admission=admission,
                                 replicas=gen["replicas"], dp=trainer["dp"], shared_prompt=shared)
    return shapes


def _nonneg_lstsq(X: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: a term that fits negative is dropped and the rest
    refit (a few terms, so this simple active set is enough)."""
    active = list(range(len(X[0])))
    while True:
        A = torch.tensor([[row[j] for j in active] for row in X], dtype=torch.float64)
        b = torch.tensor(y, dtype=torch.float64)[:, None]
        scale = A.abs().amax(dim=0).clamp(min=1e-12)  # columns of very different size
        coef = (torch.linalg.lstsq(A / scale, b).solution[:, 0] / scale).tolist()
        negative = [j for j, c in zip(active, coef) if c < 0]
        if not negative:
            out = [0.0] * len(X[0])
            for j, c in zip(active, coef):
                out[j] = c
            return out
        active.remove(min(negative, key=lambda j: coef[active.index(j)]))


def calibrate(*run_dirs: Path, concurrency: float = 1.0, skip: int = 1) -> Rates:
    """Rates fitted to the pooled steps of sync runs; runs of different response lengths separate a
    group's fixed cost from its per-token cost."""
    gen_X, gen_y, train_X, train_y = [], [], [], []
    barrier, push, scored, handoff = [], [], [], []
    for run_dir in map(Path, run_dirs):
        shapes = shapes_of(run_dir)
        events = [e for f in sorted((run_dir / "timeline").glob("rank*.jsonl")) for e in _lines(f)
                  if e["step"] >= skip and e["step"] in shapes]
        by = collections.defaultdict(list)  # (executor, rank, step) -> events
        for e in events:
            by[e["executor"], e["rank"], e["step"]].append(e)
        _generator_rows(by, shapes, gen_X, gen_y)
        trainer_rank = min(r for (x, r, _) in by if x == "trainer")
        for (ex, rank, step), evs in by.items():
            if ex == "reward":
                scored += [e["t1"] - e["t0"] for e in evs if e["kind"] == "scored"]
            if ex != "trainer" or rank != trainer_rank:
                continue
            trains = sorted((e for e in evs if e["kind"] == "train" and e.get("index", -1) >= 0), key=lambda e: e["t0"])
            push_ev = [e for e in evs if e["kind"] == "push"]
            if not trains or not push_ev:
                continue
            prev = trains[0]["t0"]
            for e in trains:
                train_X.append([1.0, len(shapes[step].lengths[e["index"]]), shapes[step].group_tokens(e["index"])])
                train_y.append(e["t1"] - prev)
                prev = e["t1"]
            barrier.append(push_ev[0]["t0"] - trains[-1]["t1"])
            push.append(push_ev[0]["t1"] - push_ev[0]["t0"])
            last_leave = max((m["t0"] for (x, _, s), es in by.items() if x == "generator" and s == step
                              for m in es if m["kind"] == "generated"), default=None)
            if last_leave is not None:
                handoff.append(trains[0]["t0"] - last_leave)
    gen = GenRates(**dict(zip(FITTED, _nonneg_lstsq(gen_X, gen_y))))
    group_s, sample_s, token_s = _nonneg_lstsq(train_X, train_y)
    reward_s = statistics.median(scored) if scored else 0.0
    return Rates(gen=gen, train=TrainRates(group_s=group_s, sample_s=sample_s, token_s=token_s,
                                           barrier_s=statistics.median(barrier),
                                           push_s=statistics.median(push)),
                 reward_group_s=reward_s, concurrency=concurrency,
                 # in a sync run the trainer starts once the last group is scored and delivered
                 handoff_s=max(0.0, statistics.median(handoff) - reward_s) if handoff else 0.0)


def _generator_rows(by: dict, shapes: dict[int, StepShape], X: list, y: list) -> None:
    """Per group: the work the engine replay says its replica had done when it left -> the time."""
    for (ex, rank, step), evs in by.items():
        marks = sorted((e for e in evs if e["kind"] == "generated"), key=lambda e: e["t0"])
        start = [e["t0"] for e in evs if e["kind"] == "generate"]
        if ex != "generator" or not marks or not start:
            continue
        done, at = GenFeatures(), {}
        for index, work in shapes[step].replay(sorted(e["index"] for e in marks)):
            done = done + work
            at[index] = done
        for e in marks:
            X.append([getattr(at[e["index"]], name) for name in FITTED.values()])
            y.append(e["t0"] - start[0])


def fit_concurrency(rates: Rates, periodic_dir: Path, *, skip: int = 1) -> float:
    """The concurrency under which the model's periodic step time matches a periodic run's median
    (its shapes are its own: same seeds, same samples as the sync run)."""
    shapes = shapes_of(Path(periodic_dir))
    steps = [s for s in sorted(shapes) if s >= skip]
    measured = statistics.median(row["step_s"] for row in _lines(Path(periodic_dir) / "metrics.jsonl")
                                 if row["step"] in steps)

    def error(c: float) -> float:
        r = dataclasses.replace(rates, concurrency=c)
        return abs(statistics.median(simulate(shapes[s], r, schedule="periodic").step_s for s in steps) - measured)

    return min((c / 100 for c in range(100, 19, -1)), key=error)  # ties: the least slow-down


def swap_seconds(colocated_dir: Path, *, skip: int = 1) -> float:
    """The median per step of a co-located run's memory moves (its offload and onload spans)."""
    per_step: dict[int, float] = collections.defaultdict(float)
    for path in sorted((colocated_dir / "timeline").glob("rank*.jsonl"))[:1]:  # every rank moves alike
        for e in _lines(path):
            if e["kind"] in ("offload", "onload") and e["step"] >= skip:
                per_step[e["step"]] += e["t1"] - e["t0"]
    if not per_step:
        raise ValueError(f"{colocated_dir}: no offload/onload spans (not a placement=colocated run?)")
    return statistics.median(per_step.values())
