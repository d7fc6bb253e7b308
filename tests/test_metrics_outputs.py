"""metrics.png and the TensorBoard event files, read back with matplotlib and TensorBoard's own reader."""
from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path

import matplotlib.image
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tidal.controller import metrics
from tidal.controller.control import Decision, decision_key
from tidal.controller.metrics import MetricsWriter, build_row, headers, post_metrics
from tidal.controller.metrics_plot import _panels, plot_metrics
from tidal.controller.timeline import _BUSY, figure, plot, utilisation
from tidal.controller.tensorboard import TensorBoardLog, tags_of


def scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value}, as TensorBoard shows them (the newest event of a step wins)."""
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_metrics_png_draws_the_panels_present(tmp_path):
    rows = [{"step": s, "trainer/reward_mean": 0.1 * s, "trainer/kl": None if s == 1 else 0.01, "generator/gen_s": 0.2,
             "trainer/train_s": 0.3, "trainer/rollout_digest": "ab"} for s in range(4)]
    rows[0]["eval/pass@1"], rows[2]["eval/pass@1"], rows[2]["eval/pass@4"] = 0.0, 0.5, 0.75
    assert _panels(rows) == {"reward": ["trainer/reward_mean"], "eval pass rate": ["eval/pass@1", "eval/pass@4"],
                             "KL to the reference": ["trainer/kl"],
                             "step time split (s)": ["generator/gen_s", "trainer/train_s"]}
    assert "KL to the reference" not in _panels([{**row, "trainer/kl": 0.0} for row in rows])  # beta = 0: no KL panel
    assert plot_metrics(rows, tmp_path / "metrics.png")
    image = matplotlib.image.imread(tmp_path / "metrics.png")
    assert image.shape[:2] == (560, 1100)  # 2 rows of 2 panels at 100 dpi
    assert not plot_metrics([{"step": 0, "rollout_digest": "ab"}], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_a_row_namespaces_every_field_and_the_step_level_keys_stay_flat():
    records = {"generator": {"gen_s": 1.0, "sampled": 3},
               "reward": {"score_s": 0.1, "eval/pass@1": 0.5},  # a field with a "/": namespaced already
               "trainer": {"loss": 0.2, "sampled": 4, "tpspd": 1.0},
               "eval_sampler": {"gen_s": 0.7},
               "eval": {"reward_mean": 0.9, "loss": 9.0}}
    walls = {name: float(i) for i, name in enumerate(records)}
    row = build_row(3, records, walls, {"step_s": 5.0, "tpspd": 2.0})
    assert row == {"step": 3,
                   "generator/gen_s": 1.0, "generator/sampled": 3, "reward/score_s": 0.1, "eval/pass@1": 0.5,
                   "trainer/loss": 0.2, "trainer/sampled": 4, "trainer/tpspd": 1.0, "eval_sampler/gen_s": 0.7,
                   "eval/reward_mean": 0.9, "eval/loss": 9.0,
                   "generator_s": 0.0, "reward_s": 1.0, "trainer_s": 2.0, "eval_sampler_s": 3.0, "eval_s": 4.0,
                   "step_s": 5.0, "tpspd": 2.0}  # the derived figures: step-level, flat
    # the console's titles: the field's name where it is the only one of that name shown
    assert headers(["step", "trainer/loss", "trainer/reward_mean", "eval/reward_mean", "step_s"]) == \
        ["step", "loss", "trainer/reward_mean", "eval/reward_mean", "step_s"]


def test_tensorboard_tags_and_a_resumed_run_writes_each_step_once(tmp_path):
    records = {"trainer": {"loss": 0.0}, "reward": {"score_s": 0.0, "eval/pass@1": 0.0}}
    row = build_row(0, records, {"trainer": 1.0, "reward": 1.0}, {"step_s": 0.0})
    tags = tags_of(row, executors=records, derived={"step_s": 0.0})
    # the namespaced keys, the wall times and the derived figures
    assert tags == {"trainer_s": "time/trainer_s", "reward_s": "time/reward_s", "step_s": "step/step_s",
                    "trainer/loss": "trainer/loss", "reward/score_s": "reward/score_s", "eval/pass@1": "eval/pass@1"}
    first = TensorBoardLog(tmp_path, first_step=0)
    for step in range(3):
        first.write({"step": step, "trainer/loss": float(step), "trainer/done": True,
                     "trainer/rollout_digest": "x", "trainer/push_end_t": 1e9}, tags=tags)
    first.close()
    resumed = TensorBoardLog(tmp_path, first_step=1)  # steps 1 and 2 are redone, with other values
    for step in (1, 2, 3):
        resumed.write({"step": step, "trainer/loss": 10.0 + step}, tags=tags)
    resumed.close()
    assert scalars(tmp_path) == {"trainer/loss": {0: 0.0, 1: 11.0, 2: 12.0, 3: 13.0}}


class _Store:
    """The rendezvous store's get/set, in memory."""

    def __init__(self):
        self.kv = {}

    def set(self, key: str, value: str) -> None:
        self.kv[key] = value

    def get(self, key: str) -> str:
        return self.kv[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.kv for k in keys)


def test_metrics_writer_rows_and_tensorboard_are_namespaced(tmp_path, monkeypatch):
    """The writer's thread on posted records: rows with the namespaced keys; TensorBoard with the same tags."""
    store = _Store()
    monkeypatch.setattr(metrics, "store_client", lambda timeout: store)
    for step in range(2):
        store.set(decision_key(step), json.dumps(dataclasses.asdict(Decision(checkpoint=False, stop=step == 1))))
        post_metrics(store, step=step, executor="generator", wall_s=1.0,
                     record={"gen_s": 0.5 + step, "gen_start_t": 100.0})
        post_metrics(store, step=step, executor="trainer", wall_s=2.0,
                     record={"loss": 0.25 * step, "reward_mean": 0.5, "push_end_t": 103.0})
        post_metrics(store, step=step, executor="eval", wall_s=0.1, record={"reward_mean": 0.75} if step == 0 else {})
    writer = MetricsWriter(executors=["generator", "trainer", "eval"], steps=range(2), path=tmp_path / "metrics.jsonl",
                           console_keys=["step", "trainer/loss", "eval/reward_mean"], timeout=timedelta(seconds=5),
                           derive=lambda r: {"step_s": r["trainer"]["push_end_t"] - r["generator"]["gen_start_t"]},
                           sinks=[TensorBoardLog(tmp_path / "tensorboard", first_step=0)]).start()
    writer.join()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for step, row in enumerate(rows):
        assert row["trainer/loss"] == 0.25 * step and "loss" not in row
        assert row["generator/gen_s"] == 0.5 + step
        assert row["trainer/reward_mean"] == 0.5 and row["step_s"] == 3.0 and row["trainer_s"] == 2.0
    assert rows[0]["eval/reward_mean"] == 0.75 and "eval/reward_mean" not in rows[1]
    board = scalars(tmp_path / "tensorboard")
    assert board.keys() == {"generator/gen_s", "trainer/loss", "trainer/reward_mean", "eval/reward_mean",
                            "time/generator_s", "time/trainer_s", "time/eval_s", "step/step_s"}
    assert board["trainer/loss"] == {0: 0.0, 1: 0.25} and board["eval/reward_mean"] == {0: 0.75}


def _span(executor, rank, step, kind, t0, t1, **kw):
    return {"executor": executor, "rank": rank, "step": step, "kind": kind, "t0": t0, "t1": t1, **kw}


def synthetic_timeline(steps: int) -> list[dict]:
    """A periodic GRPO run's spans, 13.6 s a step: 10 s of generation; four reward spans of 1.6 ms (as
    measured on a real run), each followed by a 3 s train (they overlap); a 0.5 s barrier, a 0.1 s push."""
    events = [_span(ex, r, -1, "imports", 0.0, 2.0) for r, ex in enumerate(("generator", "reward", "trainer"))]
    t = 5.0
    for step in range(steps):
        events += [_span("generator", 0, step, "step", t, t + 10), _span("generator", 0, step, "generate", t, t + 10)]
        for i in range(4):
            done = t + 2.5 * (i + 1)
            events += [_span("reward", 1, step, "scored", done, done + 0.0016, index=i),
                       _span("trainer", 2, step, "train", done + 0.01, done + 3.01, index=i)]
        end = t + 13.01
        events += [_span("trainer", 2, step, "barrier", end, end + 0.5),
                   _span("trainer", 2, step, "push", end + 0.5, end + 0.6)]
        t = end + 0.6
    return events


def _inside_figure(fig, artist) -> bool:
    fig.canvas.draw()
    box, page = artist.get_window_extent(), fig.bbox
    return page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1


def test_timeline_of_a_long_run_draws_the_last_steps_and_every_step_s_busy_fraction(tmp_path):
    import matplotlib.pyplot as plt

    events = synthetic_timeline(300)
    executors, steps, busy = utilisation(events)
    assert executors == ["generator", "reward", "trainer"] and steps == list(range(300))
    step_s = 13.61
    # the trainer's overlapping train spans count once: 2.51 s after the step began until the push ended
    for row, expected in zip(busy, (10 / step_s, 4 * 0.0016 / step_s, (step_s - 2.51) / step_s)):
        assert row[0] == pytest.approx(expected, rel=1e-6) and row[-1] == pytest.approx(expected, rel=1e-6)
    fig = figure(events, detail_steps=20)
    strip, detail = (ax for ax in fig.axes if ax.get_label() != "<colorbar>")
    assert "0.047% busy" in strip.get_yticklabels()[1].get_text()
    lo, hi = detail.get_xlim()  # the last 20 steps only, in seconds since step 280 began
    assert -20 * step_s * 0.1 < lo < 0 and 20 * step_s < hi < 20 * step_s * 1.1
    assert "step 280" in detail.get_xlabel()
    assert _inside_figure(fig, fig.legends[0])
    plt.close(fig)
    plot(events, tmp_path / "timeline.png")
    height, width = matplotlib.image.imread(tmp_path / "timeline.png").shape[:2]
    assert width == 1320 and 600 < height < 800


def test_timeline_legend_of_every_kind_stays_inside_the_figure():
    """All 13 kinds in one legend row ran past both edges of the 12-inch figure; now it wraps."""
    import matplotlib.pyplot as plt

    events = synthetic_timeline(3)
    events += [_span("trainer", 2, 2, kind, 40.0 + i, 40.5 + i) for i, kind in enumerate(_BUSY)]
    fig = figure(events)
    assert len([ax for ax in fig.axes]) == 1  # a short run: spans only, start-up included
    assert len(fig.legends[0].get_texts()) == len(_BUSY)
    assert _inside_figure(fig, fig.legends[0])
    plt.close(fig)


def test_progress_is_plain_lines_off_a_terminal_and_tqdm_on_one(capsys, monkeypatch):
    import os
    import sys

    from tqdm import tqdm

    from tidal.controller.metrics import PlainProgress, progress

    bar = progress(total=3, first=5)  # pytest's captured stderr is no terminal
    assert isinstance(bar, PlainProgress)
    bar.every_s = 3600
    bar.write("a step table")
    bar.update()
    bar.update()
    bar.update()  # the last step prints its line whatever the time
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "a step table" and len(lines) == 2
    assert lines[1].startswith("progress: 8/8 steps done, ") and lines[1].endswith(" s/step, 0.0 min left")
    _, terminal = os.openpty()
    with open(terminal, "w") as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        bar = progress(total=3, first=0)
        assert isinstance(bar, tqdm)
        bar.close()


def test_loading_bars_stay_out_of_logs(tmp_path):
    """transformers draws a "Loading weights" bar per model load, on every rank: a log that is no terminal
    gets none (transformers 5 draws none on a terminal either; global rank 0's would be kept)."""
    import os
    import subprocess
    import sys

    from tidal.modeling.hf import load_model, load_tokenizer, save_hf

    save_hf(load_model(None), load_tokenizer(None), tmp_path)
    root = Path(__file__).resolve().parents[1]

    def stderr_of(code: str, rank: str) -> str:
        return subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "RANK": rank},
                              capture_output=True, text=True, timeout=120, check=True).stderr

    plain = f"import transformers; transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})"
    assert "Loading weights" in stderr_of(plain, "0")  # what a rank's log got
    ours = f"from tidal.modeling.hf import load_model; load_model({str(tmp_path)!r})"
    assert "Loading weights" not in stderr_of(ours, "0")  # rank 0's: the one a terminal would keep


def test_step_figures_read_records_that_carry_the_ranks_device_peak():
    """On an accelerator the loop adds device_peak_gb to every executor's record (tidal/controller/loop.py); the
    recipe's figures read the executors' own fields beside it (the lent H100 failed every job here once)."""
    from tidal.executors.generator.executor import GeneratorMetrics
    from tidal.executors.trainer.stats import TrainerMetrics
    from tidal.recipes.grpo import step_figures

    gen = {f.name: 0 for f in dataclasses.fields(GeneratorMetrics)}
    gen.update(gen_start_t=10.0, gen_end_t=14.0, gen_s=4.0, device_peak_gb=1.5)
    trn = {f.name: None for f in dataclasses.fields(TrainerMetrics)}
    trn.update(tokens=600, train_s=3.0, push_end_t=16.0, first_train_t=12.0, device_peak_gb=1.5)
    figures = step_figures({"generator": gen, "trainer": trn}, world_size=3)
    assert figures == {"step_s": 6.0, "tpspd": 600 / 6.0 / 3, "gen_idle_frac": 1 - 4.0 / 6.0,
                       "train_idle_frac": 0.5, "first_group_s": 2.0, "overlap_s": 2.0}
