"""Wall-clock spans per rank (group generated, scored, trained, barrier, push, ...)."""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path


class Timeline:
    def __init__(self, *, executor: str, rank: int):
        self.executor, self.rank, self.step = executor, rank, -1
        self.events: list[dict] = []

    @classmethod
    def resumed(cls, *, executor: str, rank: int, path: Path, before: int) -> "Timeline":
        """A timeline that keeps this rank's saved events of the steps before `before` (a resumed
        run continues the file; a fresh run has none)."""
        timeline = cls(executor=executor, rank=rank)
        if before > 0 and path.is_file():
            events = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
            timeline.events = [e for e in events if e["step"] < before]
        return timeline

    @contextmanager
    def span(self, kind: str, **attrs):
        t0 = time.time()
        try:
            yield
        finally:
            self.events.append({"executor": self.executor, "rank": self.rank, "step": self.step,
                                "kind": kind, "t0": t0, "t1": time.time(), **attrs})

    def add(self, kind: str, t0: float, t1: float, **attrs) -> None:
        """A span measured elsewhere (start-up, before this timeline existed)."""
        self.events.append({"executor": self.executor, "rank": self.rank, "step": self.step,
                            "kind": kind, "t0": t0, "t1": t1, **attrs})

    def mark(self, kind: str, **attrs) -> None:
        now = time.time()
        self.events.append({"executor": self.executor, "rank": self.rank, "step": self.step,
                            "kind": kind, "t0": now, "t1": now, **attrs})

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for event in self.events:
                f.write(json.dumps(event) + "\n")


def merge(run_dir: Path) -> list[dict]:
    """All ranks' events, sorted by start time, written to run_dir/timeline.jsonl."""
    events = [json.loads(line) for f in sorted((run_dir / "timeline").glob("rank*.jsonl"))
              for line in f.read_text().splitlines()]
    events.sort(key=lambda e: (e["t0"], e["rank"]))
    with open(run_dir / "timeline.jsonl", "w") as f:
        for event in events:
            f.write(json.dumps(event) + "\n")
    return events


# kinds drawn as busy spans, and their colours; "step" spans frame each executor's step
_BUSY = {"generate": "tab:blue", "scored": "tab:orange", "train": "tab:green", "barrier": "tab:red",
         "push": "tab:purple", "weights_recv": "lightgray", "checkpoint": "tab:brown", "eval": "tab:cyan",
         "eval_scored": "gold", "values": "tab:olive", "imports": "silver", "connect": "darkgray", "init": "dimgray"}
_LABEL = {"weights_recv": "waiting for weights", "values": "values + advantages", "imports": "start-up: python + imports",
          "connect": "start-up: process groups", "init": "start-up: executor init (model load)"}


def plot(events: list[dict], path: Path) -> None:
    """One row per (executor, rank): busy spans coloured by kind over idle time, step boundaries dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not events:
        return
    t_start = min(e["t0"] for e in events)
    rows = sorted({(e["rank"], e["executor"]) for e in events})
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.6 * len(rows)))
    for y, (rank, executor) in enumerate(rows):
        mine = [e for e in events if e["rank"] == rank and e["executor"] == executor]
        for kind, colour in _BUSY.items():
            spans = [(e["t0"] - t_start, max(e["t1"] - e["t0"], 1e-4)) for e in mine if e["kind"] == kind]
            if spans:
                ax.broken_barh(spans, (y - 0.35, 0.7), color=colour, label=_LABEL.get(kind, kind))
    for e in events:
        if e["kind"] == "push":
            ax.axvline(e["t1"] - t_start, color="k", linestyle="--", linewidth=0.6)
    ax.set_yticks(range(len(rows)), [f"{ex} (rank {r})" for r, ex in rows])
    ax.set_xlabel("seconds since the run started (dashed: barrier + weight push done)")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if unique:  # a user graph may record only controller "step" spans
        ax.legend(unique.values(), unique.keys(), loc="upper center", bbox_to_anchor=(0.5, -0.35),
                  ncol=len(unique), fontsize=8)
    ax.set_title("busy spans per executor (white = idle)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def process_start_time() -> float | None:
    """Wall clock at which this process started (Linux /proc, 10 ms resolution), for the start-up
    span; None elsewhere. Both /proc values count from boot, so their difference is the process age."""
    try:
        started = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        uptime = float(open("/proc/uptime").read().split()[0])
        return time.time() - (uptime - started)
    except (OSError, ValueError, IndexError):
        return None
