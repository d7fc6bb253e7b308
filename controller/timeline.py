"""Wall-clock spans per rank (group generated, scored, trained, barrier, push, ...)."""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path


class Timeline:
    def __init__(self, *, executor: str, rank: int):
        self.executor, self.rank, self.step = executor, rank, -1
        self.events: list[dict] = []

    @contextmanager
    def span(self, kind: str, **attrs):
        t0 = time.time()
        try:
            yield
        finally:
            self.events.append({"executor": self.executor, "rank": self.rank, "step": self.step,
                                "kind": kind, "t0": t0, "t1": time.time(), **attrs})

    def mark(self, kind: str, **attrs) -> None:
        now = time.time()
        self.events.append({"executor": self.executor, "rank": self.rank, "step": self.step,
                            "kind": kind, "t0": now, "t1": now, **attrs})

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for event in self.events:
                f.write(json.dumps(event) + "\n")
