"""Partial rollouts on a long tail: step time, time per trained group and trained tokens/s, with and without
`generator.partial_rollout_tokens`, under sync, periodic and offpolicy k=1, on the same job in one run.

The job needs a long tail, which the embedded model does not have (its samples all run to
max_new_tokens): the bench first trains it for `--tail-steps` steps to write short answers
(reward `short`: 1 - characters / 30), which leaves most samples at a few tokens and a few
running to max_new_tokens=64, the shape of a reasoning model's lengths. Then each configuration
runs `--steps` steps from that model, `--repeats` times (alternating); the first 4 steps are skipped
(warm-up, and with partial rollouts the steps before the pipeline of cut groups fills). A step
trains a varying number of groups with partial rollouts, so the fair figure is seconds per
trained group (the steps' time over the groups they trained), beside the median step. The planner's
prediction of each sync, periodic and partial-rollout row's trained tokens/s sits beside it
(tidal/planner/partial.py; rates calibrated on the first sync run, lengths of its measured steps).

The engine alone (`--part engine --model DIR --data FILE`): `--prompts` prompts x 4 samples x
128 tokens generated whole, then in pieces of 32 (each cut group resumed by the next call, its KV
computed again), with the weights unchanged: the time of each and whether the tokens are the same.

Multi-turn episodes (`--part turns`): the embedded model with the `LongTail` environment below, whose episodes
are one turn long except 1 prompt in 16, whose run 8 turns: sync, periodic, periodic with
partial rollouts of 16 and 32 tokens (episodes cut within their turns) and offpolicy, in one run.

    .venv/bin/python bench/partial.py [--repeats 3] [--steps 14] [--tail-steps 30]
    .venv/bin/python bench/partial.py --part turns [--repeats 2] [--steps 14]
    .venv/bin/python bench/partial.py --part engine --model /path/to/hf --data prompts.jsonl [--prompts 4]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import zlib
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tidal.launch import jobs  # noqa: E402

JOB = ["generator.max_new_tokens=64", "reward.functions=[bench.partial:short]", "logging.samples_every=1"]
CONFIGS = {
    "sync": (("--schedule", "sync"), ()),
    "periodic": ((), ()),
    "periodic, N=16": ((), ("generator.partial_rollout_tokens=16",)),
    "periodic, N=32": ((), ("generator.partial_rollout_tokens=32",)),
    "offpolicy k=1": (("--schedule", "offpolicy"), ()),
    "offpolicy k=1, N=16": (("--schedule", "offpolicy"), ("generator.partial_rollout_tokens=16",)),
}
SKIP = 4
TURNS_JOB = ["rollout=multi_turn", "multi_turn.env=bench.partial:LongTail", "multi_turn.max_turns=8",
             "reward.functions=[bench.partial:short]"]
TURNS_CONFIGS = {name: CONFIGS[name] for name in ("sync", "periodic", "periodic, N=16", "periodic, N=32", "offpolicy k=1")}


class LongTail:
    """Episodes of one turn, except 1 prompt in 16 (by its text), whose run 8 turns: a multi-turn long tail."""
    deterministic = True
    inline = True

    def __init__(self, sample: dict):
        self.turns = 8 if zlib.crc32(sample["prompt"].encode()) % 16 == 0 else 1

    def reset(self):
        return None

    def step(self, turn):
        from tidal.executors.environments.base import EnvStep

        return EnvStep(observation=" go on", done=turn.index + 1 >= self.turns)


def short(prompt: str, response: str, sample: dict) -> float:
    """Short answers score: the reward that gives the bench's model its long tail."""
    return max(0.0, 1.0 - len(response) / 30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--tail-steps", type=int, default=30)
    p.add_argument("--part", choices=["job", "engine", "turns"], default="job")
    p.add_argument("--model", help="--part engine: an HF model directory")
    p.add_argument("--data", help="--part engine: a JSONL file with a `prompt` column (chat template applied)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--keep", type=Path, help="keep the runs in this directory (the planner's inputs: sync0, periodic0)")
    args = p.parse_args()
    if args.part == "engine":
        return engine(args)
    if args.part == "turns":
        return turns(args)
    with tempfile.TemporaryDirectory(prefix="tidal-bench-partial-") as tmp:
        tmp = args.keep or Path(tmp)
        jobs.run("grpo", "--overwrite", output_dir=tmp / "tail", steps=args.tail_steps, overrides=JOB, nproc=3)
        model = [f"model.path={tmp / 'tail/final'}"]
        runs = {name: [] for name in CONFIGS}
        for k in range(args.repeats):
            for name, (flags, sets) in CONFIGS.items():
                # the first sync and periodic runs stay: the planner calibrates on them (tidal/planner/calibrate.py)
                out = tmp / (f"{name}0" if k == 0 and name in ("sync", "periodic") else "run")
                runs[name].append(jobs.run("grpo", "--overwrite", *flags, output_dir=out,
                                           steps=args.steps, overrides=[*JOB, *model, *sets], nproc=3).metrics[SKIP:])
        predicted = predictions(tmp / "sync0", tmp / "periodic0")
    base, sync_tps = per_group(runs["periodic"]), tokens_per_s(runs["sync"])
    table = []
    for name, repeats in runs.items():
        steps = [r for rows in repeats for r in rows]
        med_step = statistics.median(r["step_s"] for r in steps)
        g = per_group(repeats)
        table.append([name, f"{med_step:.2f}", f"{g:.3f}", " ".join(f"{group_s(rows):.3f}" for rows in repeats),
                      f"{base / g:.2f}x", f"{tokens_per_s(repeats):.0f}", f"{tokens_per_s(repeats) / sync_tps:.2f}x",
                      f"{predicted[name]:.0f}" if name in predicted else "",
                      f"{tokens_per_s(repeats) / predicted[name] - 1:+.0%}" if name in predicted else "",
                      f"{statistics.mean(r['trainer/groups'] for r in steps):.1f}",
                      f"{statistics.mean(r['trainer/response_len_mean'] for r in steps if r['trainer/groups']):.1f}",
                      f"{statistics.mean(r['trainer/staleness_mean'] for r in steps if r['trainer/groups']):.2f}",
                      max(r["trainer/staleness_max"] for r in steps)])
    print(f"\nlong-tail job (the embedded model after {args.tail_steps} steps of short answers, max_new_tokens=64, "
          f"B=8, G=16): {args.repeats} runs x {args.steps - SKIP} steps per configuration (the first {SKIP} skipped)")
    print(tabulate(table, headers=["configuration", "median step s", "s / trained group", "runs",
                                   "vs periodic", "trained tok/s", "vs sync", "planner's tok/s", "measured vs it",
                                   "groups / step", "response len",
                                   "staleness mean", "staleness max"]))


def predictions(sync_dir: Path, periodic_dir: Path) -> dict[str, float]:
    """The planner's trained tokens/s for the sync, periodic and partial-rollout rows: rates calibrated on the
    bench's first sync run (and its periodic run's overlap), the response lengths of the sync run's measured steps
    (tidal/planner/partial.py for the cut steps)."""
    from dataclasses import replace

    from tidal.planner.calibrate import calibrate, fit_concurrency, shapes_of
    from tidal.planner.model import simulate
    from tidal.planner.partial import budget_rows

    rates = calibrate(sync_dir, skip=SKIP)
    rates = replace(rates, concurrency=fit_concurrency(rates, periodic_dir, skip=SKIP))
    shapes = [s for step, s in sorted(shapes_of(sync_dir).items()) if step >= SKIP]
    out = {}
    for name, schedule in (("sync", "sync"), ("periodic", "periodic")):
        steps = [simulate(s, rates, schedule=schedule) for s in shapes]
        out[name] = sum(p.tokens for p in steps) / sum(p.step_s for p in steps)
    for name, (flags, sets) in CONFIGS.items():
        if flags or not sets:
            continue
        n = int(sets[0].split("=")[1])
        out[name] = next(r.tokens_per_s for r in budget_rows(shapes, rates, budgets=[n], steps=48) if r.budget == n)
    return out


def turns(args) -> None:
    """--part turns: the schedules on multi-turn episodes with a long tail of turns."""
    runs = {name: [] for name in TURNS_CONFIGS}
    with tempfile.TemporaryDirectory(prefix="tidal-bench-partial-turns-") as tmp:
        for _ in range(args.repeats):
            for name, (flags, sets) in TURNS_CONFIGS.items():
                runs[name].append(jobs.run("grpo", "--overwrite", *flags, output_dir=Path(tmp) / "run", steps=args.steps,
                                           overrides=[*TURNS_JOB, *sets], nproc=3).metrics[SKIP:])
    sync_tps = tokens_per_s(runs["sync"])
    table = [[name, f"{statistics.median(r['step_s'] for rows in repeats for r in rows):.2f}",
              f"{per_group(repeats):.3f}", f"{tokens_per_s(repeats):.0f}", f"{tokens_per_s(repeats) / sync_tps:.2f}x",
              " ".join(f"{sum(r['trainer/tokens'] for r in rows) / sum(r['step_s'] for r in rows):.0f}" for rows in repeats),
              f"{statistics.mean(r['generator/turns_mean'] for rows in repeats for r in rows if r['trainer/groups']):.2f}",
              max(r["trainer/staleness_max"] for rows in repeats for r in rows)]
             for name, repeats in runs.items()]
    print(f"\nmulti-turn long tail (the embedded model, 1 prompt in 16 runs 8 turns, the others 1; B=8, G=16): "
          f"{args.repeats} runs x {args.steps - SKIP} steps per configuration (the first {SKIP} skipped)")
    print(tabulate(table, headers=["configuration", "median step s", "s / trained group", "trained tok/s", "vs sync",
                                   "runs' tok/s", "turns / sample", "staleness max"]))


def engine(args) -> None:
    import json
    import time

    import torch

    from tidal.executors.generator.contract import PromptRequest, Resume, SamplingParams
    from tidal.executors.generator.native_engine import NativeEngine
    from tidal.modeling.hf import load_model, load_tokenizer

    torch.set_num_threads(2)
    tok, model = load_tokenizer(args.model), load_model(args.model, seed=0)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()[:args.prompts]]
    requests = [PromptRequest(index=i, prompt_ids=list(tok.apply_chat_template(
        [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]))
        for i, r in enumerate(rows)]
    params = SamplingParams(n=4, max_new_tokens=128, seed=0)
    eng = NativeEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_batch_prompts=2)
    t0 = time.perf_counter()
    whole = {g.index: g for g in eng.generate(requests, params, step=0)}
    whole_s, t0 = time.perf_counter() - t0, time.perf_counter()
    pieces, calls = {}, 0
    while requests:
        cut = []
        for g in eng.generate(requests, params, step=0, budget=32):
            (cut.append(g) if g.cut else pieces.__setitem__(g.index, g))
        requests = [PromptRequest(index=g.index, prompt_ids=g.prompt_ids_P, resume=Resume(
            step=0, index=g.index, response_ids=g.response_ids, logprobs=g.logprobs, finished_G=g.finished_G))
            for g in cut]
        calls += 1
    pieces_s = time.perf_counter() - t0
    same = all(torch.equal(a, b) for i in whole for a, b in zip(whole[i].response_ids, pieces[i].response_ids))
    print(tabulate([["whole", f"{whole_s:.1f}", "1.00x", 1, ""],
                    ["pieces of 32", f"{pieces_s:.1f}", f"{pieces_s / whole_s:.2f}x", calls, same]],
                   headers=["generation", "s", "vs whole", "calls", "same tokens"]))


def group_s(rows: list[dict]) -> float:
    """The steps' seconds over the groups they trained."""
    return sum(r["step_s"] for r in rows) / max(1, sum(r["trainer/groups"] for r in rows))


def per_group(repeats: list[list[dict]]) -> float:
    return statistics.median(group_s(rows) for rows in repeats)


def tokens_per_s(repeats: list[list[dict]]) -> float:
    """Trained tokens over the steps' seconds, the median over the runs."""
    return statistics.median(sum(r["trainer/tokens"] for r in rows) / sum(r["step_s"] for r in rows) for rows in repeats)


if __name__ == "__main__":
    main()
