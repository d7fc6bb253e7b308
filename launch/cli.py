"""`launch.py --algo NAME [--config FILE] [--set key=value ...] [--steps N] ...`

Every user mistake is one line on stderr and a non-zero exit, before any rank blocks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from recipes.config import RunConfig, config_error


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch.py", description="Tidal: on-policy RL with periodic asynchrony. "
                                "Run under torchrun --nproc-per-node N (N = ranks of the placement).")
    p.add_argument("--algo", required=True, help="algorithm name (see the registry in algorithms/)")
    p.add_argument("--config", type=Path, help="YAML or JSON run config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field by dotted key, e.g. --set trainer.lr=1e-4 (repeatable)")
    p.add_argument("--steps", type=int, help="optimizer steps (= config steps)")
    p.add_argument("--seed", type=int, help="run seed (= config seed)")
    p.add_argument("--schedule", choices=["periodic", "sync"],
                   help="periodic: train groups as they finish, barrier at the batch end; "
                        "sync: generate all, then train all (= config schedule)")
    p.add_argument("--output-dir", type=Path, help="run directory (default runs/<timestamp>)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the placement and channel graph, then exit (no torchrun needed)")
    return p


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
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"--set {spec!r}: {part!r} is not a section")
    node[parts[-1]] = yaml.safe_load(raw) if raw else ""


def resolve(args: argparse.Namespace) -> RunConfig:
    data = _load_file(args.config) if args.config else {}
    for spec in args.overrides:
        _apply_override(data, spec)
    for flag, key in (("steps", "steps"), ("seed", "seed"), ("schedule", "schedule"),
                      ("output_dir", "output_dir")):
        value = getattr(args, flag)
        if value is not None:
            data[key] = str(value) if isinstance(value, Path) else value
    source = str(args.config) if args.config else "command line"
    try:
        return RunConfig.model_validate(data).with_algorithm(args.algo)
    except ValidationError as exc:
        raise ValueError(config_error(exc, source)) from None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = resolve(args)
        from recipes.registry import recipe_for  # the executors' classes: only once the config is valid

        recipe = recipe_for(cfg.algo)
        graph = recipe.build(cfg)
        if args.dry_run:
            from launch.dryrun import describe

            print(describe(graph, cfg, recipe))
            return 0
        from launch.run import run

        run(cfg, recipe, graph)
        return 0
    except ValueError as exc:
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            print(f"error: {exc}", file=sys.stderr)
        return 2
