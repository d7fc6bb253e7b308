"""`launch.py --algo NAME [--config FILE] [--set key=value ...] [--steps N] ...`

`python launch.py ...` starts the job's ranks itself (tidal/launch/selflaunch.py); under torchrun each
rank runs the job. Every user mistake is one line on stderr and exit 2, before any rank starts
(tidal/launch/preflight.py) or, under torchrun, before any rank loads a model.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml
from pydantic import ValidationError

from tidal.common.config_errors import config_error
from tidal.launch.preflight import RunComplete
from tidal.recipes.config import RunConfig

# a rank other than 0 that meets a config error waits this long for the launcher to stop it (rank 0 says the error)
RANK_ERROR_WAIT_S = 10


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal" if Path(sys.argv[0]).name == "tidal" else "launch.py", description="Tidal: on-policy RL with periodic asynchrony. "
                                "`python launch.py` starts the placement's ranks on this machine; or run it under "
                                "torchrun --nproc-per-node N (N = ranks of the placement).")
    from tidal.algorithms.registry import ALGORITHMS  # the names as registered: a new algorithm shows up here

    p.add_argument("--algo", required=True, metavar="NAME",
                   help=f"algorithm: {', '.join(ALGORITHMS.names())} (tidal/algorithms/registry.py)")
    p.add_argument("--config", type=Path, help="YAML or JSON run config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field by dotted key, e.g. --set trainer.lr=1e-4 (repeatable)")
    p.add_argument("--steps", type=int, help="optimizer steps (= config steps)")
    p.add_argument("--seed", type=int, help="run seed (= config seed)")
    p.add_argument("--schedule", choices=["periodic", "sync", "offpolicy"],
                   help="periodic: train groups as they finish, barrier at the batch end; "
                        "sync: generate all, then train all; offpolicy: the generator runs up to "
                        "schedule.max_lag (default 1) steps ahead of the trainer (= config schedule.kind)")
    p.add_argument("--output-dir", type=Path, help="run directory (default runs/<timestamp>)")
    p.add_argument("--resume", nargs="?", const="latest", metavar="PATH",
                   help="continue the run in --output-dir from its newest complete checkpoint, or from the "
                        "checkpoint directory PATH (<run>/checkpoints/step_N: --output-dir defaults to <run>)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in an output dir that holds a run (its outputs are deleted)")
    p.add_argument("--max-restarts", type=int, metavar="N",
                   help="python launch.py only: restart the ranks up to N times after a failure, each restart "
                        "continuing from the newest checkpoint (default 0; under torchrun use its own flag)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the placement and channel graph, then exit (starts no rank)")
    p.add_argument("--plan", action="store_true",
                   help="placement planner: calibrate this job on this machine (two short runs), then print the "
                        "predicted sync and periodic step time and TPSPD of every split of --devices between "
                        "generator and trainer, and the one to use")
    p.add_argument("--devices", type=int, metavar="N", help="--plan: devices to split (default: this machine's "
                   "GPUs/NPUs, or its CPU cores)")
    p.add_argument("--rates", type=Path, metavar="FILE", help="--plan: take rates and the step's shape from FILE "
                   "instead of calibrating (e.g. configs/plan-qwen3-8b-16npu.yaml)")
    return p


def check_flags(args: argparse.Namespace) -> None:
    from tidal.launch.selflaunch import under_launcher

    if args.resume is not None and args.overwrite:
        raise ValueError("--resume and --overwrite together: --resume continues the run in the output dir, "
                         "--overwrite replaces it; pass one")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    if (args.devices is not None or args.rates is not None) and not args.plan:
        raise ValueError("--devices and --rates go with --plan")
    if args.devices is not None and args.devices < 2:
        raise ValueError(f"--devices must be 2 or more (a generator and a trainer), got {args.devices}")
    if args.plan and (args.dry_run or args.resume is not None or under_launcher()):
        raise ValueError("--plan runs on its own: not with --dry-run or --resume, nor under torchrun")
    if args.max_restarts is not None and under_launcher():
        raise ValueError("--max-restarts is for `python launch.py` (which starts the ranks); "
                         "under torchrun pass torchrun's own --max-restarts")


def _run_of(checkpoint: str) -> Path | None:
    """<run> of a checkpoint path <run>/checkpoints/step_NNNNNN; None for any other path."""
    p = Path(checkpoint)
    return p.parent.parent if re.fullmatch(r"step_\d{6,}", p.name) and p.parent.name == "checkpoints" else None


def _load_file(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"config file {path}: not valid {path.suffix.lstrip('.') or 'YAML'}: "
                         f"{str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if isinstance(data, dict):
        data.pop("_sources", None)  # a run's config.json, passed back: its record of where values came from
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: top level must be a mapping, got {type(data).__name__}")
    return data


def _apply_override(data: dict, spec: str) -> None:
    key, sep, raw = spec.partition("=")
    if not sep or not key:
        raise ValueError(f"--set {spec!r}: expected KEY=VALUE, e.g. trainer.lr=1e-4")
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        if node.get(part) is None:  # absent, or an optional section left out (a run's config.json: null)
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ValueError(f"--set {spec!r}: {part!r} is not a section")
    node[parts[-1]] = yaml.safe_load(raw) if raw else ""


def _file_source(path: Path) -> str:
    """configs/*.yaml of this repository are its presets; any other file is the user's."""
    presets = Path(__file__).resolve().parents[2] / "configs"
    return f"preset {path}" if path.resolve().parent == presets else f"file {path}"


def resolve(args: argparse.Namespace, *, rates: str = "rule") -> RunConfig:
    """The run's config from the file, --set and the flags over the defaults. rates: how the keys left to
    the launch are chosen (tidal/launch/auto.py choose): "measure" in the process that starts the ranks."""
    from tidal.recipes import defaults

    data, layers = _user_layers(args)
    from tidal.algorithms.registry import get_algorithm
    from tidal.recipes.advantages import ADVANTAGE_SOURCES

    sections = ADVANTAGE_SOURCES.get(get_algorithm(args.algo).advantage_source).sections
    free = auto_keys(data, accelerators=accelerators())
    pretrained = defaults.pretrained_defaults(data, sections=sections)
    defaults.apply(data, pretrained)
    layers.insert(0, (defaults.PRETRAINED_SOURCE, {k: v for k, v in pretrained.items()}))
    source = str(args.config) if args.config else "command line"

    def validate(values: dict) -> RunConfig:
        try:
            return RunConfig.model_validate(values).with_algorithm(args.algo)
        except ValidationError as exc:
            raise ValueError(config_error(exc, source, model=RunConfig)) from None

    choice = choose_auto(args, validate(data), free=free, rates=rates)
    if choice is not None:
        defaults.apply(data, choice.settings)
        layers.insert(0, ("auto", dict(choice.settings)))
    implied = defaults.placement_defaults(data)
    defaults.apply(data, implied)
    layers.insert(0, (defaults.PLACEMENT_SOURCE, dict(implied)))
    cfg = validate(data)
    if args.resume is not None and cfg.output_dir is None:
        raise ValueError("--resume needs --output-dir (the run to continue), or a checkpoint path "
                         "<run>/checkpoints/step_NNNNNN")
    return cfg.model_copy(update={"sources": defaults.sources(cfg.resolved(), layers), "auto": choice})


def _user_layers(args: argparse.Namespace) -> tuple[dict, list[tuple[str, dict]]]:
    """The config file, --set and the flags merged, and each as a layer (its name, the values it set)."""
    data = _load_file(args.config) if args.config else {}
    if isinstance(data.get("schedule"), str):  # `schedule: sync` names the section's kind
        data["schedule"] = {"kind": data["schedule"]}
    layers: list[tuple[str, dict]] = [(_file_source(args.config), json.loads(json.dumps(data)))] if args.config else []
    for spec in args.overrides:
        _apply_override(data, spec)
        layer: dict = {}
        _apply_override(layer, spec)
        layers.append(("--set", layer))
    for flag, key in (("steps", "steps"), ("seed", "seed"), ("schedule", "schedule"),
                      ("output_dir", "output_dir")):
        value = getattr(args, flag)
        if flag == "schedule" and value is not None:  # keeps a --set schedule.max_lag=k or a file's section
            section = data.get("schedule")
            data["schedule"] = {**(section if isinstance(section, dict) else {}), "kind": value}
            layers.append(("--schedule", {"schedule": {"kind": value}}))
        elif value is not None:
            data[key] = str(value) if isinstance(value, Path) else value
            layers.append((f"--{flag.replace('_', '-')}", {key: data[key]}))
    if args.resume not in (None, "latest") and "output_dir" not in data and _run_of(args.resume) is not None:
        data["output_dir"] = str(_run_of(args.resume))  # continue in the run the checkpoint belongs to
        layers.append(("--resume", {"output_dir": data["output_dir"]}))
    layers.append(("--algo", {"algo": args.algo}))
    return data, layers


def accelerators() -> int:
    """This machine's GPUs/NPUs; 0 on a CPU machine (its ranks share its cores: there is nothing to fill)."""
    from tidal.controller.devices import detect_device, device_count

    return device_count() if detect_device().type != "cpu" else 0


def auto_keys(data: dict, *, accelerators: int = 0) -> set[str]:
    """The keys the launch chooses (tidal/launch/auto.py): placement, schedule.kind and, for a pretrained
    model.path, the engine's slots, where unset or `auto` (an `auto` is taken out of `data`); on a machine
    of several accelerators also generator.replicas and trainer.dp, where both are."""
    from tidal.executors.generator.engines import ENGINES
    from tidal.launch.auto import LAYOUT_KEYS

    free = set()
    if isinstance(data.get("schedule"), str):  # --set schedule=NAME names the section's kind
        data["schedule"] = {"kind": data["schedule"]}
    engine = (data.get("generator") or {}).get("engine", "native") if isinstance(data.get("generator"), dict) else "native"
    try:
        slots_key = ENGINES.get(str(engine)).slots_key
    except ValueError:
        slots_key = None  # the config's validation names the field
    model = data.get("model")
    keys = ("placement", "schedule.kind") + ((slots_key,) if slots_key and isinstance(model, dict) and model.get("path")
                                             else ()) + (tuple(sorted(LAYOUT_KEYS)) if accelerators > 1 else ())
    for key in keys:
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            free.add(key)
        elif node[leaf] == "auto":
            del node[leaf]
            free.add(key)
    if not LAYOUT_KEYS <= free:  # one of the two set: the other keeps its default
        free -= LAYOUT_KEYS
    return free


def choose_auto(args: argparse.Namespace, cfg: RunConfig, *, free: set[str], rates: str):
    """tidal/launch/auto.py's choice for the free keys. A rank under `python launch.py` takes the launcher's
    (TIDAL_AUTO); under torchrun the world size and cached rates decide; a resume keeps its run's."""
    from tidal.launch.selflaunch import under_launcher
    from tidal.launch.auto import LAYOUT_KEYS, Choice, choose, with_layout
    from tidal.recipes.defaults import flatten
    from tidal.recipes.registry import recipe_for

    if not free:
        return None
    if under_launcher() and os.environ.get("TIDAL_AUTO"):
        choice = Choice.from_json(os.environ["TIDAL_AUTO"])
        return replace(choice, settings={k: v for k, v in choice.settings.items() if k in free})
    recorded = None
    if args.resume is not None and cfg.output_dir and (Path(cfg.output_dir) / "config.json").is_file():
        recorded = flatten(json.loads((Path(cfg.output_dir) / "config.json").read_text()))
    from tidal.controller.world import world_size_of

    recipe = recipe_for(cfg.algo)

    def build(placement: str, schedule: str, replicas: int, dp: int) -> int:
        update = {"placement": placement, "schedule": cfg.schedule.model_copy(update={"kind": schedule})}
        return world_size_of(recipe.build(with_layout(cfg, replicas=replicas, dp=dp).model_copy(update=update)))

    world = int(os.environ["WORLD_SIZE"]) if under_launcher() and "WORLD_SIZE" in os.environ else None
    slots_key = next((k for k in free - LAYOUT_KEYS if k.startswith("generator.")), None)
    devices = (world or accelerators()) if LAYOUT_KEYS <= free else None  # what a free layout fills
    return choose(cfg, free=free, slots_key=slots_key, build=build, world_size=world, recorded=recorded,
                  rates="cached" if world is not None else rates, devices=devices,
                  say=lambda line: print(line, file=sys.stderr, flush=True))


def _plan(args: argparse.Namespace, cfg: RunConfig, recipe) -> int:
    from tidal.planner.plan import plan_from_file, plan_here

    if args.rates:
        print(plan_from_file(args.rates, devices=args.devices))
        return 0
    from tidal.controller.devices import device_count

    devices = args.devices or max(2, device_count())
    # the job as configured; the calibration runs choose their own steps, schedule and output dir
    job = ["--algo", args.algo, *(["--config", str(args.config)] if args.config else []),
           *(["--seed", str(args.seed)] if args.seed is not None else []),
           *[arg for spec in args.overrides for arg in ("--set", spec)]]
    from tidal.controller.devices import detect_device
    from tidal.controller.world import world_size_of
    from tidal.executors.generator.engines import ENGINES
    from tidal.launch import jobs

    # on a CPU, an engine whose rank may fork: the runs' ranks fork from the warm launcher (tidal/launch/warm.py),
    # the three runs importing torch and the model code once, not once a rank each; else `python launch.py`
    warm = detect_device().type == "cpu" and ENGINES.get(cfg.generator.engine).forks

    def run(argv: list[str], nproc: int) -> tuple[int, str]:
        if warm:
            code, _, err = jobs.run_script(jobs.ROOT / "launch.py", *argv, nproc=nproc)
            return code, err
        proc = subprocess.run([sys.executable, str(jobs.ROOT / "launch.py"), *argv], capture_output=True, text=True)
        return proc.returncode, proc.stderr

    split = cfg.model_copy(update={"placement": "split", "schedule": cfg.schedule.model_copy(update={"kind": "sync"})})
    print(plan_here(job, run=run, devices=devices, gen_tp=cfg.generator.tp, train_unit=cfg.trainer.ranks_per_unit,
                    split_ranks=world_size_of(recipe.build(split)), partial=cfg.generator.partial_rollout_tokens))
    return 0


def _dry_run(cfg: RunConfig, recipe, graph) -> int:
    from tidal.launch.dryrun import describe
    from tidal.launch.memory import Shape, describe_memory

    from tidal.controller.job import with_schedule

    memory = describe_memory(cfg, Shape.of(cfg.model.path), executors=tuple(e.name for e in graph.executors))
    for line in cfg.auto.lines() if cfg.auto else ():
        print(line.removeprefix("tidal: "))
    print(describe(with_schedule(graph, cfg.schedule.build()), cfg, recipe, memory=memory))
    return 0


def check_world(cfg: RunConfig, recipe, graph, *, world_size: int) -> None:
    """A world size the placement does not fit: one line giving the --nproc-per-node of each placement
    (or why the other placement does not take this config)."""
    from tidal.controller.world import world_size_of

    need = world_size_of(graph)
    if world_size == need:
        return
    parts = " + ".join(f"{ex.name} {ex.world_size}" for ex in graph.placed)
    options = [f"placement={cfg.placement} needs --nproc-per-node {need} ({parts})"]
    other = "split" if cfg.placement == "colocated" else "colocated"
    update = {"placement": other}
    if other == "colocated" and cfg.schedule.kind != "sync":
        update["schedule"] = cfg.schedule.model_copy(update={"kind": "sync"})
    try:
        n = world_size_of(recipe.build(cfg.model_copy(update=update)))
        options.append(f"placement={other}{' --schedule sync' if 'schedule' in update else ''} needs {n}")
    except ValueError as exc:
        options.append(f"placement={other} does not take this config ({exc})")
    raise ValueError(f"world size is {world_size}, but {'; '.join(options)}")


def _refused(exc: ValueError) -> int:
    """A bad input: one line, exit 2."""
    rank = os.environ.get("RANK", "0")
    if rank != "0":
        # Every rank checks the same config and finds the same error; rank 0 says it. Exiting at once
        # here could end the job (the launcher stops the other ranks when one fails) before rank 0 has
        # printed: measured under load, the message was then missing. So wait for that stop; an error of
        # this rank alone (a file only it cannot read) is said after the wait.
        time.sleep(RANK_ERROR_WAIT_S)
        print(f"error (rank {rank}): {exc}", file=sys.stderr)
        return 2
    print(f"error: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    try:
        check_flags(args)
        from tidal.launch.selflaunch import under_launcher

        # --plan calibrates with runs of its own
        cfg = resolve(args, rates="rule" if args.plan else "cached")
        from tidal.recipes.registry import recipe_for  # the executors' classes: only once the config is valid

        recipe = recipe_for(cfg.algo)
        graph = recipe.build(cfg)
        from tidal.launch.preflight import preflight

        if args.plan:
            return _plan(args, cfg, recipe)
        preflight(cfg, resume=args.resume, overwrite=args.overwrite, writes=not args.dry_run)
        if cfg.auto is not None and cfg.auto.unmeasured and not under_launcher():
            # the process that starts the ranks measures what the launch chooses, once the inputs are checked
            cfg = resolve(args, rates="measure")
            graph = recipe.build(cfg)
        if args.dry_run:
            return _dry_run(cfg, recipe, graph)
        if under_launcher():
            from tidal.launch.run import run

            check_world(cfg, recipe, graph, world_size=int(os.environ.get("WORLD_SIZE", "1")))
            return run(cfg, recipe, graph, resume=args.resume, overwrite=args.overwrite)
    except ValueError as exc:
        return _refused(exc)
    except RunComplete as exc:  # --resume of a finished run: said, and nothing changed
        if os.environ.get("RANK", "0") == "0":
            print(f"tidal: {exc}", file=sys.stderr)
        return 0
    from tidal.controller.world import roles, world_size_of
    from tidal.launch.selflaunch import launch_here, without_max_restarts

    if cfg.auto is not None:  # the ranks take this choice rather than each making its own
        os.environ["TIDAL_AUTO"] = cfg.auto.to_json()

    return launch_here(without_max_restarts(argv), nproc=world_size_of(graph), max_restarts=args.max_restarts or 0,
                       roles=roles(graph), stop_timeout_s=cfg.stop_timeout_s)
