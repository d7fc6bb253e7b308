"""The offpolicy schedule (issue 29): the generator samples step s with the weights of barrier
s-1-k, so every trained token is exactly min(s, k) policy versions old; k = 0 is periodic bit for
bit; an off-policy run is deterministic (the same rollouts with 2 generator replicas, and resumed
from a checkpoint that keeps the pushes in flight); a stop, even in a stalled step, ends at once:
the steps run ahead are drained and so are the pushes in flight.
"""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tidal.channels.channel import Channel
from tidal.channels.kinds import Kind
from tidal.controller.graph import Graph
from tidal.controller.job import with_schedule
from tidal.controller.schedules import OffPolicy, Periodic, ScheduleConfig
from tidal.recipes.config import RunConfig
from tests.e2e import launch, metrics, sigterm_when_stalled, start, wait_for_steps

SIGNAL = ["--set", "reward.functions=[tests.rewards:length_parity]", "--set", "trainer.adam_eps=1e-3"]
OFF = ["--schedule", "offpolicy"]


def _final(out: Path) -> bytes:
    return (out / "final/model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """periodic and offpolicy k=0 (3 steps); offpolicy k=2 (6 steps, checkpoints after steps 1, 3, 5)
    with 1 and 2 generator replicas."""
    root = tmp_path_factory.mktemp("offpolicy")
    jobs = {
        "periodic": (SIGNAL, 3, 3),
        "lag0": ([*SIGNAL, *OFF, "--set", "schedule.max_lag=0"], 3, 3),
        "lag2": ([*SIGNAL, *OFF, "--set", "schedule.max_lag=2", "--set", "checkpoint_every=2",
                  "--set", "logging.plots=true"], 6, 3),
        "lag2_replicas2": ([*SIGNAL, *OFF, "--set", "schedule.max_lag=2", "--set", "generator.replicas=2"], 6, 4),
    }
    out = {}
    for name, (args, steps, nproc) in jobs.items():
        proc = launch(root / name, *args, nproc=nproc, steps=steps, timeout=400)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        out[name] = root / name
    return out


def test_max_lag_zero_is_periodic_bit_for_bit(runs):
    a, b = metrics(runs["periodic"]), metrics(runs["lag0"])
    assert [r["trainer/rollout_digest"] for r in a] == [r["trainer/rollout_digest"] for r in b]
    assert _final(runs["periodic"]) == _final(runs["lag0"])
    assert all(r["trainer/staleness_max"] == 0 for r in b)


def test_every_trained_token_is_exactly_min_step_k_versions_old(runs):
    rows = metrics(runs["lag2"])
    assert [r["step"] for r in rows] == list(range(6))
    # every group of a step was sampled by one version, so the token mean equals the max
    assert [(r["trainer/staleness_mean"], r["trainer/staleness_max"]) for r in rows] == [(min(s, 2), min(s, 2)) for s in range(6)]
    # step 0 is the same computation in both schedules; later steps sample with older weights
    periodic = metrics(runs["periodic"])
    assert rows[0]["trainer/rollout_digest"] == periodic[0]["trainer/rollout_digest"]
    assert rows[1]["trainer/rollout_digest"] != periodic[1]["trainer/rollout_digest"]


def test_two_generator_replicas_sample_the_same(runs):
    """The lagged push relays from the first replica to the second: both sample what one would."""
    a, b = metrics(runs["lag2"]), metrics(runs["lag2_replicas2"])
    assert [r["trainer/rollout_digest"] for r in a] == [r["trainer/rollout_digest"] for r in b]
    assert _final(runs["lag2"]) == _final(runs["lag2_replicas2"])


def test_resume_takes_the_pushes_in_flight_and_equals_the_whole_run(runs, tmp_path):
    ckpt = runs["lag2"] / "checkpoints/step_000003"
    assert sorted(p.name for p in (ckpt / "weights_in_flight").iterdir()) == ["weights.json", "weights.rank2.pt"]
    proc = launch(tmp_path, *SIGNAL, *OFF, "--set", "schedule.max_lag=2", "--set", "checkpoint_every=2",
                  "--resume", str(ckpt), steps=6, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [4, 5]
    assert [r["trainer/staleness_max"] for r in rows] == [2, 2]  # the versions of steps 2 and 3, as in the whole run
    assert [r["trainer/rollout_digest"] for r in rows] == [r["trainer/rollout_digest"] for r in metrics(runs["lag2"])[4:]]
    assert _final(tmp_path) == _final(runs["lag2"])


def test_resume_under_another_layout_starts_from_the_checkpoint_weights(runs, tmp_path):
    """The pushes in flight were saved for 1 generator replica; with 2 the generator's first steps
    take the checkpoint's weights (fresher: staleness below k), and the run says so."""
    proc = launch(tmp_path, *SIGNAL, *OFF, "--set", "schedule.max_lag=2", "--set", "generator.replicas=2",
                  "--set", "checkpoint_every=2", "--resume", str(runs["lag2"] / "checkpoints/step_000003"),
                  steps=6, nproc=4, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kept the pushes of channel 'weights' in flight for another layout" in proc.stdout + proc.stderr
    assert [r["trainer/staleness_max"] for r in metrics(tmp_path)] == [0, 1]  # versions 4 (the checkpoint's) and 4


STALL = ["--set", "reward.functions=[tests.rewards:length_parity_then_stall]", "--set", "reward.timeout_s=2000"]


def test_a_stop_in_a_stalled_step_ends_at_once_and_resumes_equal(runs, tmp_path):
    """The reward stalls for 1000 s in step 1 while the generator runs ahead (k=2). SIGTERM drops
    step 1 within seconds (the generator's steps ahead with it: the reward drains them, the
    generator drains the pushes in flight), saves step 0, and the resumed run equals the whole one."""
    out, marker = tmp_path / "run", tmp_path / "stalled"
    args = [*SIGNAL, *OFF, "--set", "schedule.max_lag=2", "--set", "checkpoint_every=2", *STALL]
    _, err, took = sigterm_when_stalled(out, marker, *args, steps=6)
    assert took < 60, err[-3000:]  # a few seconds on a quiet machine
    assert any(line.startswith("tidal: stopped after step 0 (checkpoint") for line in err.splitlines()), err[-3000:]
    assert [r["step"] for r in metrics(out)] == [0]
    resumed = launch(out, *args, "--resume", steps=6, timeout=400)  # no stall now
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["trainer/rollout_digest"] for r in metrics(out)] == [r["trainer/rollout_digest"] for r in metrics(runs["lag2"])]
    assert _final(out) == _final(runs["lag2"])


def test_a_stop_between_steps_drains_the_pushes_in_flight(tmp_path):
    """SIGTERM at an arbitrary point of a k=2 run: every rank exits with a checkpoint."""
    out = tmp_path / "stopped"
    proc = start(out, *SIGNAL, *OFF, "--set", "schedule.max_lag=2", steps=300)
    try:
        wait_for_steps(out, 4, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)  # hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
    line = next(line for line in err.splitlines() if line.startswith("tidal: stopped after step "))
    stopped = int(line.split()[4])
    assert (out / f"checkpoints/step_{stopped:06d}/manifest.json").is_file()
    assert (out / f"checkpoints/step_{stopped:06d}/weights_in_flight/weights.rank2.pt").is_file()


def test_ppo_and_an_evaluation_run_ahead_with_the_generator(tmp_path):
    """The critic between the reward and the trainer, and the evaluation on the generator's and the
    reward's ranks (guests of both): the step ahead and the step's decision one step late hold."""
    proc = launch(tmp_path, *OFF, "--set", "eval.every=2", "--set", "eval.prompts=4", "--set", "eval.samples=2",
                  "--set", "eval.temperature=1", algo="ppo", nproc=4, steps=4, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["trainer/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert [r["step"] for r in rows if "eval/reward_mean" in r] == [0, 2]
    assert (tmp_path / "checkpoints/step_000003/weights_in_flight/weights.json").is_file()


def test_schedule_config():
    assert ScheduleConfig.model_validate("sync").kind == "sync"
    assert ScheduleConfig(kind="offpolicy").build().weights_lag == 2  # max_lag defaults to 1
    assert ScheduleConfig(kind="offpolicy", max_lag=3).weights_lag == 4
    with pytest.raises(ValueError, match="max_lag bounds the offpolicy schedule's staleness; schedule 'periodic'"):
        RunConfig.model_validate({"schedule": {"max_lag": 1}})
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        ScheduleConfig(kind="offpolicy", max_lag=-1)


def test_cli_keeps_max_lag_beside_the_schedule_flag():
    from tidal.launch.cli import parser, resolve

    cfg = resolve(parser().parse_args(["--algo", "grpo", "--set", "schedule.max_lag=3", "--schedule", "offpolicy"]))
    assert (cfg.schedule.kind, cfg.schedule.max_lag) == ("offpolicy", 3)
    assert cfg.sources["schedule.max_lag"] == "--set" and cfg.sources["schedule.kind"] == "--schedule"
    with pytest.raises(ValueError, match=r"schedule: Value error, max_lag bounds"):
        resolve(parser().parse_args(["--algo", "grpo", "--set", "schedule.max_lag=3"]))


def test_a_weights_lag_is_the_schedules():
    """The recipe leaves the WEIGHTS lag unset and the schedule sets it (tidal/controller/job.py with_schedule,
    the one place); a lag set otherwise than the schedule's is refused."""
    from tidal.recipes.grpo import build

    cfg = RunConfig.model_validate({"schedule": {"kind": "offpolicy", "max_lag": 2}}).with_algorithm("grpo")
    unset = build(cfg)
    assert [ch.lag for ch in unset.channels if ch.kind is Kind.WEIGHTS] == [None]
    graph = with_schedule(unset, cfg.schedule.build())
    assert [ch.step_lag for ch in graph.channels if ch.kind is Kind.WEIGHTS] == [3]
    assert with_schedule(graph, OffPolicy(2)) == graph
    with pytest.raises(ValueError, match=r"channel 'weights': WEIGHTS lag 3, but the periodic schedule pushes "
                                         r"weights with lag 1; run --schedule offpolicy --set schedule.max_lag=2"):
        with_schedule(graph, Periodic())
    assert [ch.step_lag for ch in with_schedule(unset, OffPolicy(1)).channels if ch.kind is Kind.WEIGHTS] == [2]


def test_only_weights_may_lag_more_than_one_step():
    from tidal.recipes.grpo import build

    graph = build(RunConfig().with_algorithm("grpo"))
    lagged = [ch if ch.name != "rollouts" else Channel(ch.name, ch.src, ch.dst, ch.kind, ch.payload, lag=2)
              for ch in graph.channels]
    with pytest.raises(ValueError, match="channel 'rollouts': lag 2; .* only WEIGHTS may lag more"):
        Graph(graph.executors, lagged)


def test_metrics_png_plots_the_staleness_of_an_offpolicy_run(runs):
    from tidal.controller.metrics_plot import _panels

    assert _panels(metrics(runs["lag2"]))["staleness (policy versions)"] == ["trainer/staleness_mean",
                                                                                  "trainer/staleness_max"]
    assert "staleness (policy versions)" not in _panels(metrics(runs["periodic"]))
    assert (runs["lag2"] / "metrics.png").stat().st_size > 10_000
