"""Per-step metrics: each executor's leader posts its record to the store; rank 0 merges and writes.

A row of metrics.jsonl is every executor's record (its fields), `<executor>_s` (the controller's
wall time of that executor's step) and what `derive` computes from the records, keyed by executor.

The writer is a thread on global rank 0, so collecting metrics never adds a barrier between
executors (a world-wide gather at the step end would stall periodic asynchrony).
"""
from __future__ import annotations

import json
import math
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Mapping, Sequence

from tabulate import tabulate
from tqdm import tqdm

from controller.control import Decision
from controller.world import store_client


def _key(step: int, executor: str) -> str:
    return f"metrics/{step}/{executor}"


class MetricsWriter:
    def __init__(self, *, executors: Sequence[str], steps: range, path: Path,
                 console_keys: Sequence[str] | None, timeout: timedelta, derive=None):
        self.executors, self.steps, self.path = list(executors), steps, path
        self.console_keys, self.derive = console_keys, derive
        self._store = store_client(timeout)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tidal-metrics", daemon=True)

    def start(self) -> "MetricsWriter":
        self._thread.start()
        return self

    def join(self) -> None:
        self._thread.join()
        if self._error:
            raise self._error

    def _run(self) -> None:
        try:
            with open(self.path, "a") as f, tqdm(total=len(self.steps), desc="steps", file=sys.stderr,
                                                 dynamic_ncols=True) as bar:
                for step in self.steps:
                    row: dict = {"step": step}
                    records = {}
                    for name in self.executors:
                        posted = json.loads(self._store.get(_key(step, name)))
                        records[name] = posted["record"]
                        row.update(posted["record"])
                        row[f"{name}_s"] = posted["wall_s"]
                    if self.derive:
                        row.update(self.derive(records))
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    bar.update(1)
                    keys = [k for k in (self.console_keys or row) if k in row]
                    bar.write(tabulate([[row[k] for k in keys]], headers=keys, floatfmt=".4g"))
                    if Decision.read(self._store, step).stop:  # decided before any record of the step
                        break
        except BaseException as exc:  # surfaced by join()
            self._error = exc


def post_metrics(store, *, step: int, executor: str, wall_s: float, record: Mapping[str, object]) -> None:
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    store.set(_key(step, executor), json.dumps({"record": clean, "wall_s": wall_s}))
