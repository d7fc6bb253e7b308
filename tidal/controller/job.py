"""Run one graph as one torchrun job: devices, process groups, watchdog, metrics, controller."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from tidal.channels.kinds import Kind
from tidal.common.host_memory import map_large_blocks
from tidal.controller.control import Cadence, StepControl, install_stop_signals
from tidal.controller.failure import Watchdog
from tidal.controller.graph import Graph
from tidal.controller.loop import Controller
from tidal.controller.report import Report, Reporting
from tidal.controller.schedules import Schedule, get_schedule
from tidal.controller.timeline import process_start_time
from tidal.controller.world import build_world, check_world_size, device_index, placement, store_client
from tidal.controller.world import roles as rank_roles
from tidal.controller.devices import detect_device, init_distributed, pin_threads


@dataclass(frozen=True)
class Start:
    """Where a job starts: step 0 of a fresh run, or the step after a checkpoint's."""

    step: int = 0
    checkpoint: str | None = None  # the checkpoint directory a resumed run loads


@dataclass(frozen=True)
class Outcome:
    stopped_after: int | None = None  # the step a signal stopped the run after (its checkpoint is complete)
    signum: int = 0
    output_dir: Path | None = None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.stopped_after is not None else 0


def run_job(graph: Graph, *, steps: int, seed: int, output_dir: Path | Callable[[], Path],
            start: Callable[[Path], Start] = lambda _: Start(), schedule: str | Schedule = "periodic",
            cadence: Cadence = Cadence(), timeout_s: float = 1800.0, on_ready: Callable | None = None,
            reporting: Reporting = Reporting()) -> Outcome:
    """Every rank calls this. Raises ValueError before any collective if the world size is wrong, or
    (on every rank alike) when `start` refuses the output dir. `start(output_dir)` runs on rank 0
    only, which prepares the directory; every rank gets its answer."""
    entered = time.time()
    check_world_size(graph, int(os.environ.get("WORLD_SIZE", "1")))
    schedule = get_schedule(schedule) if isinstance(schedule, str) else schedule
    graph, timeout = with_schedule(graph, schedule), timedelta(seconds=timeout_s)
    rank, device = _connect(graph, timeout=timeout)
    output_dir = _agreed_dir(output_dir)
    begin = _shared_start(lambda: output_dir.mkdir(parents=True, exist_ok=True) or start(output_dir), timeout=timeout)
    install_stop_signals(store_client(timeout))
    world = build_world(graph, device=device, seed=seed, output_dir=output_dir, timeout=timeout,
                        resume=Path(begin.checkpoint) if begin.checkpoint else None)
    startup = _startup(entered, rank=rank, output_dir=output_dir)
    watchdog = Watchdog(rank=rank, roles=rank_roles(graph)).start()
    outcome, control = Outcome(output_dir=output_dir), None
    try:
        if on_ready:
            on_ready(world)
        control = _step_control(graph, world, rank=rank, cadence=cadence, output_dir=output_dir, timeout=timeout)
        steps_run = range(begin.step, steps)
        report = Report.open(graph, reporting, rank=rank, output_dir=output_dir, steps=steps_run, timeout=timeout,
                             watchdog=watchdog)
        stopped = Controller(world=world, steps=steps_run, schedule=schedule, control=control, startup=startup).run()
        outcome = _outcome(stopped, world=world, output_dir=output_dir)
        report.wait()
        dist.barrier(group=world.control_group)  # every rank has saved its timeline
        report.close()
    except BaseException as exc:
        watchdog.fail(exc)
    if control is not None:
        control.close()
    watchdog.stop()
    dist.destroy_process_group()
    return outcome


def _connect(graph: Graph, *, timeout: timedelta) -> tuple[int, object]:
    """This rank's threads pinned, its device taken and the process group joined: (rank, device)."""
    pin_threads()
    map_large_blocks()  # before the models load: see tidal/common/host_memory.py
    index = device_index(graph, rank=int(os.environ.get("RANK", "0")), local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    device = init_distributed(detect_device(), timeout=timeout, index=index)
    return dist.get_rank(), device


def _agreed_dir(output_dir: Path | Callable[[], Path]) -> Path:
    """Rank 0 decides (e.g. a timestamp) and every rank reads it, so all agree on one directory; the
    key outlives an elastic restart, so a restarted job continues in the same directory."""
    return Path(shared_value("output_dir", lambda: str(output_dir() if callable(output_dir) else output_dir),
                             per_attempt=False))


def _startup(entered: float, *, rank: int, output_dir: Path) -> tuple:
    """The start-up's spans for the timeline (the imports where the process's start is known, the
    connection); rank 0 says the ranks are connected."""
    started = process_start_time()
    if rank == 0:
        n = dist.get_world_size()
        print(f"tidal: {n} rank{'s' if n != 1 else ''} connected in {time.time() - (started or entered):.1f} s; "
              f"output in {output_dir}; loading the models", file=sys.stderr, flush=True)
    return ((("imports", started, entered),) if started else ()) + (("connect", entered, time.time()),)


def _step_control(graph: Graph, world, *, rank: int, cadence: Cadence, output_dir: Path,
                  timeout: timedelta) -> StepControl:
    # the decider: the first rank of the last executor, whose streamed phase ends last
    decider = placement(graph)[graph.placed[-1].name][0][0]
    return StepControl(store=store_client(timeout), watch_store=store_client(timeout), rank=rank, decider=decider,
                       cadence=cadence, run_dir=output_dir, ahead=world.runs_ahead)


def _outcome(stopped, *, world, output_dir: Path) -> Outcome:
    """A finished run's, or a stopped one's once its checkpoint is sealed: nobody exits before, as
    torchrun ends the whole group when one rank exits non-zero."""
    if stopped is None:
        return Outcome(output_dir=output_dir)
    if stopped.saved_here:
        world.store.wait([f"ckpt/{stopped.after}/done"])
    return Outcome(stopped_after=stopped.after, signum=stopped.signum, output_dir=output_dir)


def with_schedule(graph: Graph, schedule: Schedule) -> Graph:
    """The graph as `schedule` runs it: a WEIGHTS channel whose lag is unset takes the schedule's
    (offpolicy: max_lag + 1); one set otherwise is refused (a lag of 2 or more outside the offpolicy
    schedule would train samples of older weights as if they were on-policy)."""
    channels = []
    for ch in graph.channels:
        if ch.kind is Kind.WEIGHTS and ch.lag is None:
            ch = dataclasses.replace(ch, lag=schedule.weights_lag)
        if ch.kind is Kind.WEIGHTS and ch.step_lag != schedule.weights_lag:
            fix = (f"run --schedule offpolicy --set schedule.max_lag={ch.step_lag - 1}" if ch.step_lag > 1 else
                   "leave the channel's lag unset: the schedule sets it")
            raise ValueError(f"channel {ch.name!r}: WEIGHTS lag {ch.step_lag}, but the {schedule.name} schedule "
                             f"pushes weights with lag {schedule.weights_lag}; {fix}")
        channels.append(ch)
    return Graph(graph.executors, channels)


def _shared_start(make: Callable[[], Start], *, timeout: timedelta) -> Start:
    """Rank 0 prepares the run's start (it may hash a large checkpoint); a refusal is raised on every
    rank alike."""
    def answer() -> str:
        try:
            return json.dumps({"start": make().__dict__})
        except ValueError as exc:
            return json.dumps({"error": str(exc)})

    reply = json.loads(shared_value("start", answer, timeout=timeout))
    if "error" in reply:
        raise ValueError(reply["error"])
    return Start(**reply["start"])


def shared_value(key: str, make: Callable[[], str], *, per_attempt: bool = True,
                 timeout: timedelta = timedelta(seconds=60)) -> str:
    """A value rank 0 decides and every rank reads (e.g. a timestamped output dir). per_attempt=False:
    decided once per run (compare-and-set), so an elastic restart reads the first attempt's value."""
    store = store_client(timeout, per_attempt=per_attempt)
    if dist.get_rank() == 0:
        store.compare_set(key, "", make())
    return store.get(key).decode()
