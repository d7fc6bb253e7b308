"""Rank 0's account of a run: the metrics rows (metrics.jsonl, the console, other sinks), the progress
line while a step is quiet, and the plots at the end. run_job opens it once the world is up and
closes it after every rank has stopped; the other ranks hold one that does nothing."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Sequence

from tidal.controller.graph import Graph
from tidal.controller.metrics import MetricsWriter, Sink
from tidal.controller.metrics_plot import plot_metrics
from tidal.controller.timeline import merge, plot
from tidal.controller.world import titles


@dataclass(frozen=True)
class Reporting:
    """What a job reports besides metrics.jsonl."""

    console_keys: Sequence[str] | None = None  # the console table's columns (None: every key)
    derive: Callable[[dict], dict] | None = None  # the step's figures from its executors' records
    # (output_dir, first_step) -> the rows' other destinations (TensorBoard, W&B), closed after the plots
    sinks: Callable[[Path, int], list[Sink]] = lambda output_dir, first_step: []
    progress_every_s: float = 30.0  # a quiet step's progress line, after this many seconds
    plots: bool = True  # timeline.png and metrics.png at the end


class Report:
    """Rank 0's: open() starts the rows' writer, wait() waits for the last step's row, close() draws
    the plots (every rank's timeline saved by then) and closes the sinks."""

    def __init__(self, writer: MetricsWriter | None = None, sinks: Sequence[Sink] = (), *,
                 output_dir: Path | None = None, plots: bool = False):
        self.writer, self.sinks, self.output_dir, self.plots = writer, list(sinks), output_dir, plots

    @classmethod
    def open(cls, graph: Graph, reporting: Reporting, *, rank: int, output_dir: Path, steps: range,
             timeout: timedelta, watchdog) -> "Report":
        if rank != 0:
            return cls()
        sinks = reporting.sinks(output_dir, steps.start)
        writer = MetricsWriter(executors=[e.name for e in graph.executors], steps=steps,
                               path=output_dir / "metrics.jsonl", console_keys=reporting.console_keys,
                               timeout=timeout, derive=reporting.derive, sinks=sinks,
                               every_s=reporting.progress_every_s, progress=titles(graph)).start()
        watchdog.before_exit(writer.drain)  # a failed run still prints the rows of the steps that finished
        return cls(writer, sinks, output_dir=output_dir, plots=reporting.plots)

    def wait(self) -> None:
        if self.writer:
            self.writer.join()

    def close(self) -> None:
        if self.writer is None:
            return
        events, metrics = merge(self.output_dir), self.output_dir / "metrics.jsonl"
        if self.plots:
            plot(events, self.output_dir / "timeline.png")
        if self.plots and metrics.is_file():  # all the run's steps, a resumed run's earlier ones too
            plot_metrics([json.loads(line) for line in metrics.read_text().splitlines() if line.strip()],
                         self.output_dir / "metrics.png")
        for sink in self.sinks:
            sink.close()
