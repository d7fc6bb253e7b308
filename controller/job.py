"""Run one graph as one torchrun job: devices, process groups, watchdog, metrics, controller."""
from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Callable, Sequence

import torch.distributed as dist

from controller.failure import Watchdog
from controller.graph import Graph
from controller.loop import Controller
from controller.metrics import MetricsWriter
from controller.schedules import get_schedule
from controller.timeline import merge, plot
from controller.world import build_world, check_world_size, store_client
from controller.devices import detect_device, init_distributed, pin_threads


def run_job(graph: Graph, *, steps: int, seed: int, output_dir: Path | Callable[[], Path],
            schedule: str = "periodic", checkpoint_every: int = 0,
            timeout_s: float = 1800.0, console_keys: Sequence[str] | None = None,
            derive: Callable[[dict], dict] | None = None, on_ready: Callable | None = None) -> None:
    """Every rank calls this. Raises ValueError before any collective if the world size is wrong."""
    check_world_size(graph, int(os.environ.get("WORLD_SIZE", "1")))
    pin_threads()
    timeout = timedelta(seconds=timeout_s)
    device = init_distributed(detect_device(), timeout=timeout)
    rank = dist.get_rank()
    # rank 0 decides (e.g. a timestamp) and every rank reads it, so all agree on one directory
    output_dir = Path(shared_value("output_dir", lambda: str(output_dir() if callable(output_dir) else output_dir)))
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "metrics.jsonl").unlink(missing_ok=True)
    world = build_world(graph, device=device, seed=seed, output_dir=output_dir, timeout=timeout)
    watchdog = Watchdog(rank=rank, executor=world.local_name).start()
    try:
        if on_ready:
            on_ready(world)
        writer = None
        if rank == 0:
            writer = MetricsWriter(executors=[e.name for e in graph.executors], steps=range(steps),
                                   path=output_dir / "metrics.jsonl", console_keys=console_keys,
                                   timeout=timeout, derive=derive).start()
        Controller(world=world, steps=range(steps), schedule=get_schedule(schedule),
                   checkpoint_every=checkpoint_every).run()
        if writer:
            writer.join()
        dist.barrier(group=world.control_group)  # every rank has saved its timeline
        if rank == 0:
            plot(merge(output_dir), output_dir / "timeline.png")
    except BaseException as exc:
        watchdog.fail(exc)
    watchdog.stop()
    dist.destroy_process_group()


def shared_value(key: str, make: Callable[[], str]) -> str:
    """A value rank 0 decides and every rank reads (e.g. a timestamped output dir)."""
    store = store_client(timedelta(seconds=60))
    if dist.get_rank() == 0:
        store.set(key, make())
    return store.get(key).decode()
