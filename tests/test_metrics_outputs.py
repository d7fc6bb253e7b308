"""metrics.png and the TensorBoard event files, read back with matplotlib and TensorBoard's own reader."""
from __future__ import annotations

from pathlib import Path

import matplotlib.image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from controller.metrics_plot import _panels, plot_metrics
from controller.tensorboard import TensorBoardLog, tags_of


def scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value}, as TensorBoard shows them (the newest event of a step wins)."""
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_metrics_png_draws_the_panels_present(tmp_path):
    rows = [{"step": s, "reward_mean": 0.1 * s, "kl": None if s == 1 else 0.01, "gen_s": 0.2, "train_s": 0.3,
             "rollout_digest": "ab"} for s in range(4)]
    rows[0]["eval/pass@1"], rows[2]["eval/pass@1"], rows[2]["eval/pass@4"] = 0.0, 0.5, 0.75
    assert _panels(rows) == {"reward": ["reward_mean"], "eval pass rate": ["eval/pass@1", "eval/pass@4"],
                             "KL to the reference": ["kl"], "step time split (s)": ["gen_s", "train_s"]}
    assert "KL to the reference" not in _panels([{**row, "kl": 0.0} for row in rows])  # beta = 0: no KL panel
    assert plot_metrics(rows, tmp_path / "metrics.png")
    image = matplotlib.image.imread(tmp_path / "metrics.png")
    assert image.shape[:2] == (560, 1100)  # 2 rows of 2 panels at 100 dpi
    assert not plot_metrics([{"step": 0, "rollout_digest": "ab"}], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_tensorboard_tags_and_a_resumed_run_writes_each_step_once(tmp_path):
    records = {"trainer": {"loss": 0.0}, "reward": {"score_s": 0.0, "eval/pass@1": 0.0}}
    tags = tags_of(records, {"step_s": 0.0})
    assert tags == {"trainer_s": "time/trainer_s", "reward_s": "time/reward_s", "step_s": "step/step_s",
                    "loss": "trainer/loss", "score_s": "reward/score_s", "eval/pass@1": "eval/pass@1"}
    first = TensorBoardLog(tmp_path, first_step=0)
    for step in range(3):
        first.write({"step": step, "loss": float(step), "done": True, "rollout_digest": "x", "push_end_t": 1e9},
                    tags=tags)
    first.close()
    resumed = TensorBoardLog(tmp_path, first_step=1)  # steps 1 and 2 are redone, with other values
    for step in (1, 2, 3):
        resumed.write({"step": step, "loss": 10.0 + step}, tags=tags)
    resumed.close()
    assert scalars(tmp_path) == {"trainer/loss": {0: 0.0, 1: 11.0, 2: 12.0, 3: 13.0}}
