"""Periodic asynchrony vs the synchronous schedule, same job, same seed, one invocation, with the
placement planner's prediction of both (tidal/planner/).

First the planner is calibrated on three configs of its own (short sync runs for the rates, and a
periodic run of the last for how much the executors slow each other when they overlap). Then for each config:
run `sync` and `periodic` (--repeats each, alternating), skip the first step (warm-up), and take
medians. The prediction for a config uses the calibrated rates and that config's own response
lengths (the same in both schedules). From the sync runs: T_gen and T_train (training + barrier +
push); the ideal speed-up of overlapping them is (T_gen + T_train) / max(T_gen, T_train).

    .venv/bin/python bench/periodic_vs_sync.py [--repeats 5] [--steps 6]
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
from tidal.planner.plan import predict  # noqa: E402

LONG_TAIL_MODEL = "{long_tail_model}"  # made by long_tail_model() in the run's temp dir
# generator and trainer on one core each (reward is light); 3 ranks on this 2-core machine
CONFIGS = {
    "default (train 2x gen)": [],
    "balanced": ["generator.max_new_tokens=32", "data.prompts_per_step=16"],
    "gen 2x train": ["generator.max_new_tokens=96", "generator.max_batch_prompts=1"],
    # the embedded model with an EOS that fires at random: half the groups stop early, half at the cap
    "long tail": [f"model.path={LONG_TAIL_MODEL}", "generator.max_new_tokens=96", "generator.samples_per_prompt=4",
                  "generator.max_batch_prompts=4", "data.prompts_per_step=16"],
}
# lengths, batch sizes and group sizes none of the configs above has: a group's fixed and per-token
# costs come apart, a forward's fixed and per-row costs, and the cost of groups joining a live batch
CALIBRATION = {"cal: 16 rows x 8 tokens": ["generator.max_new_tokens=8", "generator.max_batch_prompts=1",
                                            "data.prompts_per_step=16"],
               "cal: 64 rows x 64 tokens": ["generator.max_new_tokens=64", "generator.max_batch_prompts=4",
                                             "data.prompts_per_step=16"],
               "cal: uneven, 8 per group": [f"model.path={LONG_TAIL_MODEL}", "generator.max_new_tokens=48",
                                             "generator.samples_per_prompt=8", "generator.max_batch_prompts=4",
                                             "data.prompts_per_step=16"]}


def long_tail_model(path: Path) -> str:
    """The embedded model (seed 1) whose EOS row of the (tied) embedding, all zeros at init since it
    is the pad row, is set at random: per-token EOS odds then vary with the context, so response
    lengths spread from 2 tokens to the cap (a long tail, as reasoning models show)."""
    import torch

    from tidal.modeling.hf import load_model, load_tokenizer

    tok, model = load_tokenizer(None), load_model(None, seed=1)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = 0.5 * torch.randn(
            model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def run(overrides: list[str], schedule: str, steps: int, out: Path) -> list[dict]:
    """One run into `out`; its metrics rows."""
    return jobs.run("grpo", "--overwrite", "--schedule", schedule, output_dir=out,
                    steps=steps, overrides=["logging.samples_every=1", *overrides], nproc=3).metrics


def med(rows: list[dict], key) -> float:
    return statistics.median(key(r) for r in rows[1:])  # step 0 warms up


def predicted(run_dir: Path, rates) -> tuple[float, float]:
    """The planner's median sync and periodic step over a run's steps (its own response lengths)."""
    shapes = [shape for step, shape in sorted(shapes_of(run_dir).items()) if step >= 1]
    sync, periodic, _ = predict(shapes, rates, replicas=1, dp=1)
    return sync, periodic


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--only", choices=list(CONFIGS), help="run one config (the calibration runs always run)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        tail_model = long_tail_model(tmp / "long-tail-model")
        configs, calibration = ({name: [o.replace(LONG_TAIL_MODEL, tail_model) for o in overrides]
                                 for name, overrides in which.items()} for which in (CONFIGS, CALIBRATION))
        cal = [tmp / f"cal-{i}" for i in range(len(calibration))]
        for d, overrides in zip(cal, calibration.values()):
            run(overrides, "sync", args.steps, d)
        run(list(calibration.values())[-1], "periodic", args.steps, tmp / "cal-periodic")
        rates = calibrate(*cal)
        rates = dataclasses.replace(rates, concurrency=fit_concurrency(rates, tmp / "cal-periodic"))
        table = []
        for name, overrides in configs.items():
            if args.only and name != args.only:
                continue
            sync_step, per_step, t_gen, t_train, pred_sync, pred_per, digests_equal = [], [], [], [], [], [], True
            for i in range(args.repeats):
                s = run(overrides, "sync", args.steps, tmp / "sync")
                for preds, value in zip((pred_sync, pred_per), predicted(tmp / "sync", rates)):
                    preds.append(value)
                q = run(overrides, "periodic", args.steps, tmp / "periodic")
                digests_equal &= [r["trainer/rollout_digest"] for r in s] == [r["trainer/rollout_digest"] for r in q]
                sync_step.append(med(s, lambda r: r["step_s"]))
                per_step.append(med(q, lambda r: r["step_s"]))
                t_gen.append(med(s, lambda r: r["generator/gen_s"]))
                t_train.append(med(s, lambda r: r["trainer/train_s"] + r["trainer/push_s"]))
            tg, tt = statistics.median(t_gen), statistics.median(t_train)
            ms, mp, ps, pp = (statistics.median(x) for x in (sync_step, per_step, pred_sync, pred_per))
            table.append([name, tg, tt, ms, ps, f"{(ps / ms - 1) * 100:+.0f}%", mp, pp, f"{(pp / mp - 1) * 100:+.0f}%",
                          ms / mp, (tg + tt) / max(tg, tt), "yes" if digests_equal else "NO"])
    g = rates.gen
    print(f"calibrated on {', '.join(CALIBRATION)}: decode forward {g.forward_s * 1e3:.2f} ms + {g.row_s * 1e6:.1f} us/row, "
          f"training {1 / max(rates.train.token_s, 1e-12):.0f} tokens/s + {rates.train.group_s * 1e3:.1f} ms/group, "
          f"concurrency {rates.concurrency:.2f}; medians of {args.repeats} runs x {args.steps - 1} steps")
    print(tabulate(table, floatfmt=".3f", headers=[
        "config", "T_gen s", "T_train s", "sync s", "predicted", "error", "periodic s", "predicted", "error",
        "speed-up", "bound", "same rollouts"]))


if __name__ == "__main__":
    main()
