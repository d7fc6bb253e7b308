"""--dry-run: the placement, the channel graph and the step's phases as tables, without starting any rank."""
from __future__ import annotations

from tabulate import tabulate

from tidal.controller.graph import Graph
from tidal.controller.world import placement, rank_plan, world_size_of
from tidal.recipes.base import Recipe
from tidal.recipes.config import RunConfig, non_defaults


def describe(graph: Graph, cfg: RunConfig, recipe: Recipe, *, memory: str = "") -> str:
    """memory: tidal/launch/memory.py's table, printed last."""
    units = placement(graph)
    rows = []
    for ex in graph.executors:
        ranks = [r for unit in units[ex.name] for r in unit]
        rows.append([ex.name, type(ex).__name__, _span(ranks), " ".join(_span(list(u)) for u in units[ex.name]),
                     f"{ex.host.name}'s, after its step" if ex.host else
                     f"group {graph.placed.index(ex)}: ranks {_span(ranks)}",
                     ", ".join(f"{k}={v}" for k, v in ex.describe().items())])
    channels = [[ch.name, ch.kind.value, f"{ch.src}.{ch.out_port} -> {ch.dst}.{ch.in_port}",
                 ch.payload.__name__, _when(ch.step_lag)] for ch in graph.channels]
    # "where it lives": the executor's global ranks and the function that runs the phase
    present = [ph for ph in recipe.phases if ph.executor in units]  # e.g. evaluation's only when it is on
    phases = [[f"{i}. {ph.name}", ph.executor, _span([r for u in units[ph.executor] for r in u]), ph.what, ph.where]
              for i, ph in enumerate(present, start=1)]
    n = world_size_of(graph)
    devices = [[rank, executors, "none (CPU only)" if index is None else f"accelerator {index}",
                "nccl/hccl + gloo" if backend == "device" else "gloo"]
               for rank, executors, index, backend in rank_plan(graph)]
    return "\n\n".join([
        f"algo {cfg.algo}, schedule {cfg.schedule}, placement {cfg.placement}, world size {n} "
        f"(torchrun --nproc-per-node {n} launch.py --algo {cfg.algo} ...)" + _partial(cfg) + _isolation(cfg),
        tabulate(rows, headers=["executor", "class", "global ranks", "units", "process group", "parallel"],
                 disable_numparse=True),
        "on a GPU/NPU node (on a CPU machine every rank computes on the CPU):\n"
        + tabulate(devices, headers=["rank", "runs", "device", "group backend"], disable_numparse=True),
        tabulate(channels, headers=["channel", "kind", "route", "payload", "delivered"]),
        f"each step ({cfg.schedule} schedule, recipe {recipe.name}):\n"
        + tabulate(phases, headers=["phase", "executor", "ranks", "what", "code"], disable_numparse=True),
        "values not at their default (the rest: docs/configuration.md):\n"
        + tabulate([[k, _short(v), src] for k, v, src in non_defaults(cfg)], headers=["key", "value", "from"],
                   disable_numparse=True),
    ] + ([memory] if memory else []))


def _isolation(cfg: RunConfig) -> str:
    """A multi-turn environment that runs the model's code says how it is kept off the network."""
    if cfg.rollout != "multi_turn":
        return ""
    from tidal.executors.environments.base import isolation_note

    note = isolation_note(cfg.multi_turn.env or "lookup")
    return f"\n{note}" if note else ""


def _partial(cfg: RunConfig) -> str:
    """Partial rollouts: how far a sample may span, and so how stale its tokens may be."""
    n = cfg.generator.partial_rollout_tokens
    if n is None:
        return ""
    from tidal.executors.generator.partial import max_cuts  # light: torch and the data rows only

    cuts = max_cuts(response_tokens=cfg.response_tokens, budget=n)
    lag = cfg.schedule.weights_lag - 1
    return (f"\npartial rollouts: at most {n} tokens a sample per step, so a group spans up to {cuts + 1} steps; "
            f"a trained token is at most {cuts + lag} policy versions old ({cuts} cuts + max_lag {lag})")


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 60 else "..." + text[-57:]


def _span(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _when(lag: int) -> str:
    return {0: "same step", 1: "next step"}.get(lag, f"{lag} steps later")
