"""Run a built graph under torchrun: output dir, resolved config, metrics columns, timeline."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch.distributed as dist

from controller.graph import Graph
from launch.config import RunConfig
from launch.job import run_job

CONSOLE = ["step", "reward_mean", "reward_std", "response_len_mean", "loss", "kl", "grad_norm",
           "gen_s", "train_s", "push_s", "step_s", "first_group_s", "tpspd"]


def step_figures(row: dict, *, executors: set[str], world_size: int) -> dict:
    """Step-level figures derived from the executors' own metrics (wall clock of one host).

    step_s runs from the start of generation to the end of the weight push (the barrier); idle
    fractions are 1 - busy / step_s; overlap_s is how long training ran while generation still did.
    """
    out = {}
    if {"gen_start_t", "push_end_t"} <= row.keys():
        step_s = row["push_end_t"] - row["gen_start_t"]
    else:
        step_s = max(v for k, v in row.items() if k.endswith("_s") and k[:-2] in executors)
    out["step_s"] = step_s
    out["tpspd"] = row.get("tokens", 0) / step_s / world_size
    if "gen_s" in row:
        out["gen_idle_frac"] = max(0.0, 1 - row["gen_s"] / step_s)
    if "train_s" in row:
        out["train_idle_frac"] = max(0.0, 1 - row["train_s"] / step_s)
    if row.get("first_train_t") and "gen_start_t" in row:
        out["first_group_s"] = row["first_train_t"] - row["gen_start_t"]
        out["overlap_s"] = max(0.0, row["gen_end_t"] - row["first_train_t"])
    return out


def run(cfg: RunConfig, graph: Graph) -> None:
    executors = {ex.name for ex in graph.executors}
    world_size = sum(ex.world_size for ex in graph.executors)

    def output_dir() -> Path:
        return Path(cfg.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")

    def write_config(world) -> None:
        if dist.get_rank() == 0:
            (world.env.output_dir / "config.json").write_text(json.dumps(cfg.resolved(), indent=2))

    run_job(graph, steps=cfg.steps, seed=cfg.seed, output_dir=output_dir, checkpoint_every=cfg.checkpoint_every,
            timeout_s=cfg.timeout_s, console_keys=CONSOLE, on_ready=write_config,
            derive=lambda row: step_figures(row, executors=executors, world_size=world_size))
