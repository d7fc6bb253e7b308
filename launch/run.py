"""Run a built graph under torchrun: output dir, resolved config, metrics columns."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch.distributed as dist

from controller.graph import Graph
from launch.config import RunConfig
from launch.job import run_job

CONSOLE = ["step", "reward_mean", "reward_std", "response_len_mean", "loss", "kl", "grad_norm",
           "gen_s", "train_s", "push_s", "step_s", "tpspd"]


def derive(row: dict) -> dict:
    """Step-level figures from the executors' own: wall time of the step and tokens/s/device."""
    step_s = max(v for k, v in row.items() if k.endswith("_s") and k[: -2] in _EXECUTORS)
    return {"step_s": step_s, "tpspd": row.get("tokens", 0) / step_s / _WORLD[0]}


_EXECUTORS: set[str] = set()
_WORLD = [1]


def run(cfg: RunConfig, graph: Graph) -> None:
    _EXECUTORS.update(ex.name for ex in graph.executors)
    _WORLD[0] = sum(ex.world_size for ex in graph.executors)

    def output_dir() -> Path:
        return Path(cfg.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")

    def write_config(world) -> None:
        if dist.get_rank() == 0:
            (world.env.output_dir / "config.json").write_text(json.dumps(cfg.resolved(), indent=2))

    run_job(graph, steps=cfg.steps, seed=cfg.seed, output_dir=output_dir, checkpoint_every=cfg.checkpoint_every,
            timeout_s=cfg.timeout_s, console_keys=CONSOLE, derive=derive, on_ready=write_config)
