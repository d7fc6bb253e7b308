"""Wall-clock spans per rank (group generated, scored, trained, barrier, push, ...)."""
from __future__ import annotations

import bisect
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path


class Timeline:
    def __init__(self, *, executor: str, rank: int, progress=None):
        """progress: where an executor's leader tells the console what it is doing (tidal/controller/progress.py)."""
        self.executor, self.rank, self.step, self.progress = executor, rank, -1, progress
        self.events: list[dict] = []

    @classmethod
    def resumed(cls, *, executor: str, rank: int, path: Path, before: int, progress=None) -> "Timeline":
        """A timeline that keeps this rank's saved events of the steps before `before` (a resumed
        run continues the file; a fresh run has none)."""
        timeline = cls(executor=executor, rank=rank, progress=progress)
        if before > 0 and path.is_file():
            events = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
            timeline.events = [e for e in events if e["step"] < before]
        return timeline

    @contextmanager
    def span(self, kind: str, **attrs):
        t0 = time.time()
        if self.progress is not None:
            self.progress.event(step=self.step, kind=kind, phase="begin", t=t0)
        try:
            yield
        finally:
            t1 = time.time()
            self.events.append({"executor": self.executor, "rank": self.rank, "step": self.step,
                                "kind": kind, "t0": t0, "t1": t1, **attrs})
            if self.progress is not None:
                self.progress.event(step=self.step, kind=kind, phase="end", t=t1)

    def add(self, kind: str, t0: float, t1: float, **attrs) -> None:
        """A span measured elsewhere (start-up, before this timeline existed)."""
        self.events.append({"executor": self.executor, "rank": self.rank, "step": self.step,
                            "kind": kind, "t0": t0, "t1": t1, **attrs})

    def mark(self, kind: str, **attrs) -> None:
        now = time.time()
        self.events.append({"executor": self.executor, "rank": self.rank, "step": self.step,
                            "kind": kind, "t0": now, "t1": now, **attrs})
        if self.progress is not None:
            self.progress.event(step=self.step, kind=kind, phase="mark", t=now)

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


# the last steps drawn span by span; a longer run adds a whole-run utilisation strip above them
DETAIL_STEPS = 20
# waiting, not working: drawn in the detail (it explains idle time) but not counted as busy
_WAITING = {"weights_recv"}


def step_windows(events: list[dict]) -> dict[int, tuple[float, float]]:
    """step -> (start, end) in wall time. A step ends when its last span ends (the barrier and weight
    push, in a GRPO graph) and the next one starts there, so the windows tile the run after start-up
    even where an executor's next step began early (the generator waits for weights inside it)."""
    last: dict[int, float] = {}
    for e in events:
        if e["step"] >= 0:
            last[e["step"]] = max(last.get(e["step"], e["t1"]), e["t1"])
    windows, start = {}, min((e["t0"] for e in events if e["step"] >= 0), default=0.0)
    for step in sorted(last):
        windows[step] = (start, max(start, last[step]))
        start = windows[step][1]
    return windows


def utilisation(events: list[dict]) -> tuple[list[str], list[int], list[list[float]]]:
    """(executors, steps, busy[executor][step]): the fraction of each step's wall time each executor was
    busy, as the mean over its ranks of the union of its busy spans (so overlapping spans count once)."""
    windows = step_windows(events)
    steps = sorted(windows)
    first_rank: dict[str, int] = {}
    for e in events:
        first_rank[e["executor"]] = min(first_rank.get(e["executor"], e["rank"]), e["rank"])
    executors = sorted(first_rank, key=first_rank.get)
    busy = []
    for executor in executors:
        ranks = sorted({e["rank"] for e in events if e["executor"] == executor})
        per_rank = [_busy_per_window(sorted((e["t0"], e["t1"]) for e in events if e["rank"] == rank
                                            and e["executor"] == executor and e["kind"] in _BUSY
                                            and e["kind"] not in _WAITING), [windows[s] for s in steps])
                    for rank in ranks]
        busy.append([sum(col) / len(ranks) for col in zip(*per_rank)])
    return executors, steps, busy


def _busy_per_window(spans: list[tuple[float, float]], windows: list[tuple[float, float]]) -> list[float]:
    """Fraction of each window covered by the union of `spans` (sorted by start)."""
    merged: list[list[float]] = []
    for t0, t1 in spans:
        if merged and t0 <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t1)
        else:
            merged.append([t0, t1])
    # windows tile the time in order: each span visits only the windows it overlaps (a 10k-step run
    # with thousands of spans stays linear)
    covered = [0.0] * len(windows)
    ends = [w1 for _, w1 in windows]
    for t0, t1 in merged:
        i = bisect.bisect_right(ends, t0)
        while i < len(windows) and windows[i][0] < t1:
            covered[i] += max(0.0, min(t1, windows[i][1]) - max(t0, windows[i][0]))
            i += 1
    return [c / (w1 - w0) if w1 > w0 else 0.0 for c, (w0, w1) in zip(covered, windows)]


def figure(events: list[dict], *, detail_steps: int = DETAIL_STEPS):
    """The timeline figure: busy spans per (executor, rank) over the last `detail_steps` steps (all of a
    run that short, start-up included), and above them, for a longer run, each executor's busy fraction
    of every step of the run. At hundreds of steps the spans alone turn into solid rows (a 2 ms reward
    span is a pixel wide, and there are several per step), which says nothing about how busy a rank was."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted({e["step"] for e in events if e["step"] >= 0})
    rows = sorted({(e["rank"], e["executor"]) for e in events})
    long_run = len(steps) > detail_steps
    shown = [e for e in events if e["step"] >= steps[-detail_steps]] if long_run else events
    strip_h = 0.9 + 0.35 * len({ex for _, ex in rows})
    fig = plt.figure(figsize=(12, 2.2 + 0.6 * len(rows) + (strip_h if long_run else 0)), layout="constrained")
    if long_run:
        top, ax = fig.subplots(2, 1, height_ratios=[strip_h, 0.6 * len(rows) + 0.8])
        _draw_utilisation(fig, top, events)
    else:
        ax = fig.subplots()
    _draw_spans(ax, shown, rows)
    if long_run:
        ax.set_xlabel(f"seconds since step {steps[-detail_steps]} began (dashed: barrier + weight push done)")
    title = "busy spans per executor (white = idle)"
    ax.set_title(f"{title}: the last {detail_steps} of {len(steps)} steps" if long_run else title, fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if unique:  # a user graph may record only controller "step" spans
        # outside the axes, wrapped into rows: one row of every kind ran past both edges of the figure
        fig.legend(unique.values(), unique.keys(), loc="outside lower center", ncol=min(len(unique), 5), fontsize=8)
    return fig


def _draw_spans(ax, events: list[dict], rows: list[tuple[int, str]]) -> None:
    t_start = min(e["t0"] for e in events)
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
    ax.set_ylim(len(rows) - 0.5, -0.5)  # rank 0 on top, as in the utilisation strip
    ax.set_xlabel("seconds since the run started (dashed: barrier + weight push done)")


def _draw_utilisation(fig, ax, events: list[dict]) -> None:
    executors, steps, busy = utilisation(events)
    image = ax.imshow(busy, aspect="auto", cmap="Greens", vmin=0, vmax=1, interpolation="nearest",
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, len(executors) - 0.5, -0.5))
    # the run's mean beside each name: a colour is read only roughly
    ax.set_yticks(range(len(executors)), [f"{ex} ({_percent(sum(b) / len(b))} busy)" for ex, b in zip(executors, busy)])
    ax.set_xlabel("step")
    ax.set_title(f"busy fraction of each step's wall time, all {len(steps)} steps (mean over an executor's ranks)",
                 fontsize=10)
    fig.colorbar(image, ax=ax, label="busy", fraction=0.03, pad=0.01)


def _percent(fraction: float) -> str:
    """73%, or 0.047% for a rank that is nearly always idle (0% would read as never busy)."""
    return f"{100 * fraction:.0f}%" if fraction >= 0.01 or fraction == 0 else f"{100 * fraction:.2g}%"


def plot(events: list[dict], path: Path, *, detail_steps: int = DETAIL_STEPS) -> None:
    """timeline.png (see `figure`); nothing for a run without events."""
    if not any(e["step"] >= 0 for e in events):
        return
    import matplotlib.pyplot as plt

    fig = figure(events, detail_steps=detail_steps)
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
