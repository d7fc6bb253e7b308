"""Per-step metrics: each executor's leader posts its record to the store; rank 0 merges and writes.

A row of metrics.jsonl (`build_row`) is every executor's record, each field namespaced by its
executor (`trainer/loss`, `generator/gen_s`, the evaluation's `eval/pass@1`; a field already
holding a "/" as it is), `<executor>_s` (the controller's wall time of that executor's
step) and what `derive` computes from the records (step-level, unprefixed: `step_s`, `tpspd`, ...).

The writer is a thread on global rank 0, so collecting metrics never adds a barrier between
executors (a world-wide gather at the step end would stall periodic asynchrony).
"""
from __future__ import annotations

import json
import math
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Mapping, Protocol, Sequence

from tabulate import tabulate
from tqdm import tqdm

from tidal.controller.control import Decision, decision_key
from tidal.controller.progress import describe
from tidal.controller.samples import console_line, first_sample
from tidal.controller.tensorboard import tags_of
from tidal.controller.world import store_client


class PlainProgress:
    """The console's progress where stderr is not a terminal (a log file, a scheduler's capture):
    tqdm's redrawn bar would land there as fragments between the step tables, so instead one plain
    line, at most every `every_s` seconds and after the last step."""

    def __init__(self, *, total: int, first: int, every_s: float = 30.0):
        self.total, self.first, self.every_s, self.done = total, first, every_s, 0
        self.t0 = self.last = time.monotonic()

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def write(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last < self.every_s and self.done < self.total:
            return
        self.last = now
        per_step = (now - self.t0) / self.done
        self.write(f"progress: {self.first + self.done}/{self.first + self.total} steps done, "
                   f"{per_step:.1f} s/step, {per_step * (self.total - self.done) / 60:.1f} min left")


def progress(*, total: int, first: int):
    """tqdm's bar on a terminal, plain lines elsewhere (PlainProgress); both take write() and update()."""
    if sys.stderr.isatty():
        return tqdm(total=total, desc="steps", file=sys.stderr, dynamic_ncols=True)
    return PlainProgress(total=total, first=first)


def _key(step: int, executor: str) -> str:
    return f"metrics/{step}/{executor}"


def build_row(step: int, records: Mapping[str, Mapping[str, object]], walls: Mapping[str, float],
              derived: Mapping[str, object]) -> dict:
    """One row of metrics.jsonl from the executors' records (in graph order), their wall times and
    the derived figures: `<executor>/<field>` for every field (one with a "/" in it as it is), then
    `<executor>_s` and the derived keys."""
    row: dict = {"step": step}
    for name, record in records.items():
        row.update({field if "/" in field else f"{name}/{field}": value for field, value in record.items()})
    row.update({f"{name}_s": walls[name] for name in records})
    row.update(derived)
    return row


def headers(keys: Sequence[str]) -> list[str]:
    """The console's column titles: a key without its executor (`reward_mean` for trainer/reward_mean)
    where no other shown key ends the same, else the whole key (eval/reward_mean beside it)."""
    short = [k.split("/", 1)[-1] for k in keys]
    return [s if short.count(s) == 1 else k for k, s in zip(keys, short)]


class Sink(Protocol):
    """A destination of the metrics rows besides metrics.jsonl (tidal/controller/tensorboard.py, tidal/controller/wandb_log.py)."""

    def write(self, row: dict, *, tags: Mapping[str, str]) -> None:
        """tags: row key -> tag (tensorboard.tags_of)."""

    def close(self) -> None:
        """The run's end, after its plots are drawn."""


class _Drained(Exception):
    """drain() ended the wait for a step's records."""


class MetricsWriter:
    def __init__(self, *, executors: Sequence[str], steps: range, path: Path,
                 console_keys: Sequence[str] | None, timeout: timedelta, derive=None,
                 sinks: Sequence[Sink] = (), every_s: float = 30.0, progress: dict[str, str] | None = None):
        """sinks: where each row goes besides metrics.jsonl (TensorBoard, W&B), made by the caller on its thread
        (a failure there, no package or a read-only dir, stops the job before step 0 instead of silently ending the
        metrics thread) and closed by it."""
        self.executors, self.steps, self.path = list(executors), steps, path
        # the progress line's clauses: a placed executor -> its title (tidal/controller/progress.py describe)
        self.progress = progress if progress is not None else {name: name for name in self.executors}
        self.sinks = list(sinks)
        self.console_keys, self.derive = console_keys, derive
        self.samples_path, self._samples_offset = path.parent / "samples.jsonl", 0
        self._store = store_client(timeout)
        # the console is never quiet longer than this while a step runs (or the job starts): a line
        # says what each executor is doing (tidal/controller/progress.py)
        self.every_s, self._quiet_since, self._began = every_s, time.monotonic(), time.time()
        self._error: BaseException | None = None
        self._give_up_at = math.inf  # drain(): when to stop waiting for a step's records
        self._thread = threading.Thread(target=self._run, name="tidal-metrics", daemon=True)

    def _wait(self, keys: list[str], *, step: int, bar) -> None:
        while not self._store.check(keys):
            if time.monotonic() > self._give_up_at:
                raise _Drained
            time.sleep(0.1)
            if time.monotonic() - self._quiet_since >= self.every_s:
                bar.write(f"tidal: step {step}, {time.time() - self._began:.0f} s into the run: "
                          f"{describe(self._store, self.progress)}")
                self._quiet_since = time.monotonic()

    def start(self) -> "MetricsWriter":
        self._thread.start()
        return self

    def join(self) -> None:
        self._thread.join()
        if self._error:
            raise self._error

    def drain(self, *, wait_s: float = 2.0) -> None:
        """The job is ending on a failure: print the rows of the steps that every executor finished
        (the last may be posted a moment after a peer's error), then stop waiting. Without it the
        console of a run stopped in step 1 could lack step 0's row and its reward warning."""
        self._give_up_at = time.monotonic() + wait_s
        self._thread.join(timeout=wait_s + 1.0)

    def _run(self) -> None:
        try:
            with open(self.path, "a") as f, progress(total=len(self.steps), first=self.steps.start) as bar:
                for step in self.steps:
                    self._wait([decision_key(step)], step=step, bar=bar)
                    decision = Decision.read(self._store, step)  # published before any record of the step
                    if decision.abort:  # a stop dropped the step: it has no records
                        break
                    self._wait([_key(step, name) for name in self.executors], step=step, bar=bar)
                    records, walls = {}, {}
                    for name in self.executors:
                        posted = json.loads(self._store.get(_key(step, name)))
                        records[name], walls[name] = posted["record"], posted["wall_s"]
                    derived = self.derive(records) if self.derive else {}
                    row = build_row(step, records, walls, derived)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    tags = tags_of(row, executors=self.executors, derived=derived)
                    for sink in self.sinks:
                        sink.write(row, tags=tags)
                    bar.update(1)
                    keys = [k for k in (self.console_keys or row) if k in row]
                    bar.write(tabulate([[row[k] for k in keys]], headers=headers(keys), floatfmt=".4g"))
                    # the trainer appended the step's samples before it posted its record
                    sample, self._samples_offset = first_sample(self.samples_path, step, self._samples_offset)
                    if sample is not None:
                        bar.write(console_line(sample))
                    warning = reward_warning(row)
                    if warning:
                        bar.write(warning)
                    self._quiet_since = time.monotonic()
                    if decision.stop:
                        break
        except _Drained:
            pass
        except BaseException as exc:  # surfaced by join()
            self._error = exc


def reward_warning(row: Mapping[str, object], *, limit: int = 300) -> str | None:
    """One console line when more than half of a step's rewards failed: under reward.on_error=zero
    they score 0 and the run looks like any other (reward 0), so say it, with the first error."""
    failed, samples = row.get("trainer/reward_failures") or 0, row.get("trainer/samples") or 0
    if not samples or 2 * failed <= samples:
        return None
    first = str(row.get("trainer/reward_first_error") or "")
    first = first if len(first) <= limit else first[:limit - 3] + "..."
    return (f"warning: step {row['step']}: {failed} of {samples} rewards failed and scored 0 "
            f"(reward.on_error=zero); the first: {first}")


def post_metrics(store, *, step: int, executor: str, wall_s: float, record: Mapping[str, object]) -> None:
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    store.set(_key(step, executor), json.dumps({"record": clean, "wall_s": wall_s}))
