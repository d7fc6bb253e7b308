"""Run a built graph under torchrun: the output dir (fresh, resumed or restarted), the resolved
config, the recipe's metrics columns; the stop line when a signal ended the run early."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from functools import partial
from pathlib import Path

import torch.distributed as dist

from tidal.controller.checkpoint import complete_checkpoints, config_changes, latest, open_checkpoint, step_dir
from tidal.controller.control import Cadence
from tidal.controller.job import Outcome, Start, run_job
from tidal.controller.report import Reporting
from tidal.controller.devices import attempt
from tidal.controller.world import world_size_of
from tidal.executors.trainer.backends import BACKENDS
from tidal.controller.graph import Graph
from tidal.recipes.base import Recipe
from tidal.recipes.config import RunConfig

# what a run writes into its output dir; a fresh start (or --overwrite) removes the previous run's
RUN_OUTPUTS = ("config.json", "metrics.jsonl", "samples.jsonl", "eval_samples.jsonl", "timeline.jsonl", "timeline.png",
               "metrics.png", "tensorboard", "wandb", "checkpoints", "final", "timeline")


def run(cfg: RunConfig, recipe: Recipe, graph: Graph, *, resume: str | None = None, overwrite: bool = False) -> int:
    """resume: None (a fresh run), "latest" (the output dir's newest complete checkpoint) or a
    checkpoint directory. An elastic restart (torchrun --max-restarts) resumes by itself."""
    began = time.time()
    if os.environ.get("RANK", "0") == "0":
        print(numerics_line(cfg), file=sys.stderr, flush=True)
        for line in cfg.auto.lines() if cfg.auto else ():
            print(line, file=sys.stderr, flush=True)

    def output_dir() -> Path:
        return Path(cfg.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")

    def write_config(world) -> None:
        if dist.get_rank() == 0:
            # _sources: where each value came from (default, pretrained default, preset, file, --set, a flag);
            # the file can be passed back as --config, which ignores that key
            record = {**cfg.resolved(), "_sources": cfg.sources}
            (world.env.output_dir / "config.json").write_text(json.dumps(record, indent=2))

    derive = partial(recipe.derive, world_size=world_size_of(graph), run={}) if recipe.derive else None
    derive = watched(derive, cfg)
    cadence = Cadence(every=cfg.checkpoint_every, minutes=cfg.checkpoint_minutes, keep=cfg.checkpoint_keep,
                      config=cfg.resolved())
    reporting = Reporting(console_keys=recipe.console, derive=derive, sinks=partial(row_sinks, cfg),
                          progress_every_s=cfg.logging.progress_every_s, plots=cfg.logging.plots)
    outcome = run_job(graph, steps=cfg.steps, seed=cfg.seed, output_dir=output_dir, schedule=cfg.schedule.build(),
                      start=partial(start, cfg=cfg, resume=resume), cadence=cadence, timeout_s=cfg.timeout_s,
                      on_ready=write_config, reporting=reporting)
    if os.environ.get("RANK", "0") == "0":
        print(end_line(outcome, steps=cfg.steps, wall_s=time.time() - began, resume=resume_command(outcome.output_dir)),
              file=sys.stderr, flush=True)
    return outcome.exit_code


def watched(derive, cfg: RunConfig):
    """The step's figures, each step also held against the launch's plan (tidal/launch/plan_watch.py):
    a run that strays from it is told which plan its own rates favour."""
    if derive is None or cfg.auto is None or cfg.auto.chosen is None:
        return derive
    from tidal.launch.plan_watch import PlanWatch

    watch = PlanWatch(cfg, cfg.auto)

    def figures(records: dict) -> dict:
        out = derive(records)
        gen, trainer = records.get("generator", {}), records.get("trainer", {})
        if all(isinstance(v, (int, float)) for v in (out.get("step_s"), gen.get("gen_s"), trainer.get("train_s"),
                                                     trainer.get("response_len_mean"))):
            watch.observe(step_s=out["step_s"], gen_s=gen["gen_s"], train_s=trainer["train_s"],
                          length=trainer["response_len_mean"])
        return out

    return figures


def row_sinks(cfg: RunConfig, output_dir: Path, first_step: int) -> list:
    """Where the metrics rows go besides metrics.jsonl, as `logging` says (rank 0, at the run's start)."""
    sinks, log = [], cfg.logging
    if log.tensorboard:
        from tidal.controller.tensorboard import TensorBoardLog

        sinks.append(TensorBoardLog(output_dir / "tensorboard", first_step=first_step))
    if log.wandb:
        from tidal.controller.wandb_log import WandbLog

        sinks.append(WandbLog(output_dir, first_step=first_step, project=log.wandb_project, name=log.wandb_name,
                              mode=log.wandb_mode, config=cfg.resolved()))
    return sinks


def numerics_line(cfg: RunConfig) -> str:
    """The run's numerics, said first: what the sampler/trainer log-prob gap (trainer/logp_mismatch_*) will be."""
    dtype = cfg.generator_model.dtype
    if cfg.model.numerics == "exact":
        return (f"tidal: numerics exact ({dtype}): every product and attention runs as library calls of one fixed "
                f"shape, so the sampler's log-probs are the trainer's bit for bit (trainer/logp_mismatch_max 0)")
    return (f"tidal: numerics default ({dtype}): the library kernels; the sampler's and the trainer's log-probs part "
            f"by their rounding (trainer/logp_mismatch_*); --set model.numerics=exact makes them equal")


def end_line(outcome: Outcome, *, steps: int, wall_s: float, resume: str) -> str:
    """The run's last console lines: where a stop left it, or a summary of a finished run."""
    k = outcome.stopped_after
    if k is None:
        return summary(outcome.output_dir, steps=steps, wall_s=wall_s)
    if k < 0:
        return "tidal: stopped during step 0: nothing was trained, so nothing was saved; start it again"
    return (f"tidal: stopped after step {k} (checkpoint {step_dir(outcome.output_dir, k)} saved; the step in flight, "
            f"if any, is redone on resume); resume with: {resume}")


def summary(out: Path, *, steps: int, wall_s: float) -> str:
    """What a finished run made: its length, its reward and evaluation, and where its outputs are."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (out / "metrics.jsonl").is_file() else []
    lines = [f"tidal: done: step {steps - 1} of {out} reached, {wall_s:.0f} s wall for this launch"]
    if rows:
        walls = sorted(r["step_s"] for r in rows if isinstance(r.get("step_s"), (int, float)))
        # a step that trained no group (partial rollouts) has no reward_mean
        rewarded = [r for r in rows if isinstance(r.get("trainer/reward_mean"), (int, float))]
        tail = [r["trainer/reward_mean"] for r in rewarded[-20:]]
        if walls:
            lines.append(f"  median step {walls[len(walls) // 2]:.3g} s over {len(walls)} steps")
        if tail:
            lines.append(f"  reward_mean: {rewarded[0]['trainer/reward_mean']:.4g} at step {rewarded[0]['step']}, "
                         f"{sum(tail) / len(tail):.4g} over the last {len(tail)} steps")
        evals = [(r["eval/reward_mean"], r["step"]) for r in rows if isinstance(r.get("eval/reward_mean"), (int, float))]
        if evals:
            best, at = max(evals)
            lines.append(f"  best eval/reward_mean {best:.4g} at step {at} (of {len(evals)} evaluations)")
    found = complete_checkpoints(out)
    made = [name for name in ("final", "metrics.jsonl", "metrics.png", "timeline.png", "samples.jsonl",
                              "eval_samples.jsonl", "tensorboard", "wandb") if (out / name).exists()]
    lines.append(f"  outputs: {', '.join(made)}" + (f"; checkpoint {found[-1]} (extend with --resume --steps N)"
                                                     if found else ""))
    return "\n".join(lines)


def start(out: Path, *, cfg: RunConfig, resume: str | None) -> Start:
    """On rank 0, before any executor starts: pick the checkpoint to continue from (verified against
    its manifest) and make the output dir agree with it."""
    found = latest(out, hashes=True) if attempt() > 0 else None  # a restarted attempt continues its run
    if attempt() > 0:  # torchrun restarted the ranks after a failure: say so, and from where
        where = f"from checkpoint {found.path} (step {found.step + 1} on)" if found else "from step 0 (no checkpoint yet)"
        print(f"tidal: restart {attempt()} after a failure: continuing {where}", file=sys.stderr, flush=True)
    if found is None and resume == "latest":
        found = latest(out, hashes=True)
        if found is None:
            raise ValueError(f"--resume: {out} holds no complete checkpoint (checkpoints/step_*/manifest.json); "
                             f"start it again without --resume (add --overwrite)")
    elif found is None and resume is not None:
        found = open_checkpoint(Path(resume), hashes=True)
    if found is None:  # a fresh run: nothing of an earlier one may be mistaken for this one's
        for name in RUN_OUTPUTS:
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        return Start()
    changes = config_changes(found.config, cfg.resolved())
    if changes:
        raise ValueError(f"--resume: the config differs from the one checkpoint {found.path} was trained with: "
                         f"{'; '.join(changes)} (a resumed run may change only the layout, steps, timeouts, "
                         f"checkpoint and logging settings)")
    saved = tuple(found.config["trainer"].get(k, 1) for k in ("dp", "tp", "pp"))  # pp: 1 before it existed
    if BACKENDS.get(cfg.trainer.backend).per_rank_optimizer and saved != (cfg.trainer.dp, cfg.trainer.tp, cfg.trainer.pp):
        raise ValueError(f"--resume: trainer.backend={cfg.trainer.backend} keeps its optimizer state per rank, so checkpoint "
                         f"{found.path} resumes with the layout it was saved under: trainer.dp={saved[0]}, "
                         f"trainer.tp={saved[1]}, trainer.pp={saved[2]} (this run: {cfg.trainer.dp}, {cfg.trainer.tp}, "
                         f"{cfg.trainer.pp})")
    if found.step + 1 >= cfg.steps:
        raise ValueError(f"--resume: checkpoint {found.path} holds step {found.step}, the last of steps={cfg.steps}; "
                         f"raise --steps to train further")
    for name in ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl"):  # steps past the checkpoint are redone
        keep_steps_up_to(out / name, found.step)
    return Start(step=found.step + 1, checkpoint=str(found.path))


def keep_steps_up_to(path: Path, step: int) -> None:
    """Drop the lines of steps after `step` from a JSONL log, so a resumed run writes each step once."""
    if path.is_file():
        rows = [line for line in path.read_text().splitlines() if line.strip()]
        path.write_text("".join(r + "\n" for r in rows if json.loads(r)["step"] <= step))


def resume_command(output_dir: Path | None) -> str:
    """This job's command line with --resume (and its output dir), for the stop line."""
    args, skip = [], False
    for i, arg in enumerate(sys.argv[1:]):
        if skip:
            skip = False
            continue
        if arg in ("--resume", "--overwrite") or arg.startswith("--resume="):
            rest = sys.argv[2 + i:]
            skip = arg == "--resume" and bool(rest) and not rest[0].startswith("-")
            continue
        args.append(arg)
    if output_dir is not None and "--output-dir" not in args and not any(a.startswith("--output-dir=") for a in args):
        args += ["--output-dir", str(output_dir)]
    launcher = os.environ.get("TIDAL_LAUNCHER") or f"torchrun --nproc-per-node {os.environ.get('WORLD_SIZE', '1')} launch.py"
    return f"{launcher} {shlex.join(args)} --resume"
