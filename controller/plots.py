"""metrics.png: the training curves of a run, drawn by rank 0 from metrics.jsonl at the end of a job.

Drawn from the file, not from what this job's writer saw, so a resumed run plots every step of the
run. A panel whose keys no row holds is left out; a None (a non-finite value) is a gap in its line.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

PANEL_INCHES = (4.0, 2.6)  # width, height of one panel
DPI = 100
COLUMNS = 3

# (title, keys) of the panels fed by fixed keys of the GRPO-family records (executors/*/stats.py,
# executors/*/executor.py); eval/* and the per-executor times are added by `panels`
_REWARD = ("reward (train batch)", ("reward_mean",))
_LENGTH = ("response length (tokens)", ("response_len_mean", "eval/response_len_mean"))
_TRAINING = (("loss", ("loss",)), ("KL to the reference", ("kl",)), ("entropy (nats/token)", ("entropy",)),
             ("grad norm (before clipping)", ("grad_norm",)))
# busy seconds of each phase: they overlap under the periodic schedule, so lines, not a stack
_BUSY = ("busy per step (s)", ("gen_s", "eval_gen_s", "score_s", "train_s", "push_s"))
# eval/* keys drawn elsewhere: the length shares the train length's scale, the prompt count is constant
_EVAL_ELSEWHERE = ("eval/response_len_mean", "eval/prompts")


@dataclass(frozen=True)
class Series:
    label: str
    steps: list[int]
    values: list[float]  # nan where the row held None: matplotlib leaves a gap


@dataclass(frozen=True)
class Panel:
    title: str
    series: list[Series]


def read_rows(path: Path) -> list[dict]:
    """The rows of metrics.jsonl; none when the job wrote no step."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def panels(rows: Sequence[dict], *, executors: Sequence[str]) -> list[Panel]:
    """The panels the rows can fill, in drawing order. `executors`: the graph's executor names, whose
    `<name>_s` (the controller's wall time of that executor's step) make the step-time panel."""
    held = {key for row in rows for key in row}
    evals = sorted(k for k in held if k.startswith("eval/") and k not in _EVAL_ELSEWHERE)
    step_time = ("step time per executor (s)", (*(f"{name}_s" for name in executors), "step_s"))
    specs = (_REWARD, ("eval (held-out prompts)", evals), _LENGTH, *_TRAINING, step_time, _BUSY)
    found = [Panel(title, [_series(rows, key) for key in keys if key in held]) for title, keys in specs]
    return [panel for panel in found if panel.series]


def _series(rows: Sequence[dict], key: str) -> Series:
    # only the rows holding the key: eval/* exist on evaluation steps alone, and their line joins them
    mine = [row for row in rows if key in row]
    values = [math.nan if row[key] is None else float(row[key]) for row in mine]
    return Series(label=key, steps=[row["step"] for row in mine], values=values)


def figure_size(n_panels: int) -> tuple[int, int]:
    """(width, height) in pixels of the figure of `n_panels` panels."""
    cols, lines = min(n_panels, COLUMNS), math.ceil(n_panels / COLUMNS)
    return round(cols * PANEL_INCHES[0] * DPI), round(lines * PANEL_INCHES[1] * DPI)


def plot_metrics(rows: Sequence[dict], path: Path, *, executors: Sequence[str]) -> bool:
    """Write the panels of `rows` to `path`; False (and no file) when no panel has data."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a cluster node, as in controller/timeline.py
    import matplotlib.pyplot as plt

    drawn = panels(rows, executors=executors)
    if not drawn:
        return False
    width, height = figure_size(len(drawn))
    cols = min(len(drawn), COLUMNS)
    fig, axes = plt.subplots(math.ceil(len(drawn) / COLUMNS), cols, figsize=(width / DPI, height / DPI),
                             squeeze=False)
    for ax, panel in zip(axes.flat, drawn):
        _draw(ax, panel)
    for ax in list(axes.flat)[len(drawn):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def _draw(ax, panel: Panel) -> None:
    for series in panel.series:
        # markers: a 2-step run, or a value between two gaps, is a point, not a line
        ax.plot(series.steps, series.values, marker="o", markersize=3, linewidth=1.2, label=series.label,
                linestyle="--" if series.label == "step_s" else "-")
    ax.set_title(panel.title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    if len(panel.series) > 1:
        ax.legend(fontsize=6)
