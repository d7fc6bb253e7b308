"""What each executor is doing, for the console while a step runs.

A long start-up (a model loading) or a long step would otherwise be silent until the step's row
prints. Each executor's leader posts, through its timeline, the span it is in and how many of each
kind it has finished this step (`progress/<executor>` in the store); rank 0's metrics thread reads
them and prints one line whenever the console has been quiet for `every_s` seconds (tidal/controller/metrics.py),
on a terminal and in a log alike.
"""
from __future__ import annotations

import json
import time
from collections import Counter

# the events worth counting in a progress line: a group generated, scored, trained
COUNTED = {"generated": "generated", "scored": "scored", "train": "trained", "eval_scored": "evaluated"}


def _key(executor: str) -> str:
    return f"progress/{executor}"


class Progress:
    """An executor leader's side: its timeline calls `event` at each span's start and end and at each mark."""

    def __init__(self, store, executor: str, *, every_s: float = 0.5):
        self.store, self.executor, self.every_s = store, executor, every_s
        self.open: list[tuple[str, float]] = []  # spans begun and not ended: (kind, start)
        self.counts: Counter = Counter()
        self.step, self.last = None, 0.0

    def event(self, *, step: int, kind: str, phase: str, t: float) -> None:
        """phase: "begin", "end" or "mark". A begin is posted at once (it says what a long silence is);
        counts at most every `every_s` seconds."""
        if step != self.step:
            self.step, self.counts = step, Counter()
        if phase == "begin":
            self.open.append((kind, t))
        else:
            if phase == "end" and self.open:
                self.open = [s for s in self.open if s[0] != kind] if self.open[-1][0] != kind else self.open[:-1]
            if kind in COUNTED:  # a span's end, or a mark
                self.counts[COUNTED[kind]] += 1
            if t - self.last < self.every_s:
                return
        self.last = t
        doing = self.open[-1] if self.open else None
        self.store.set(_key(self.executor), json.dumps({"step": step, "doing": doing, "counts": dict(self.counts)}))


def describe(store, labels: dict[str, str], *, now: float | None = None) -> str:
    """Rank 0's side: one clause per placed executor, e.g. "trainer: train for 3 s, trained 5". `labels`:
    a placed executor's name -> what its clause is titled: its guests post through its timeline, so they
    share its clause ("generator + reward + trainer" co-located)."""
    now = time.time() if now is None else now
    parts = []
    for name, label in labels.items():
        key = _key(name)
        if not store.check([key]):
            parts.append(f"{label}: starting")
            continue
        posted = json.loads(store.get(key))
        doing = posted["doing"]
        what = f"{doing[0]} for {now - doing[1]:.0f} s" if doing else "waiting"
        counts = ", ".join(f"{kind} {n}" for kind, n in posted["counts"].items())
        parts.append(f"{label}: {what}" + (f", {counts}" if counts else ""))
    return "; ".join(parts)
