"""Run a built graph under torchrun: output dir, resolved config, the recipe's metrics columns."""
from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import torch.distributed as dist

from controller.graph import Graph
from controller.job import run_job
from controller.world import world_size_of
from recipes.base import Recipe
from recipes.config import RunConfig


def run(cfg: RunConfig, recipe: Recipe, graph: Graph) -> None:
    def output_dir() -> Path:
        return Path(cfg.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")

    def write_config(world) -> None:
        if dist.get_rank() == 0:
            (world.env.output_dir / "config.json").write_text(json.dumps(cfg.resolved(), indent=2))

    derive = partial(recipe.derive, world_size=world_size_of(graph)) if recipe.derive else None
    run_job(graph, steps=cfg.steps, seed=cfg.seed, output_dir=output_dir, schedule=cfg.schedule,
            checkpoint_every=cfg.checkpoint_every, timeout_s=cfg.timeout_s, console_keys=recipe.console,
            on_ready=write_config, derive=derive)
