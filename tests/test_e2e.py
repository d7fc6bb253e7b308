"""Whole jobs under torchrun: outputs of a run, sync == periodic bit for bit, bad input errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from tests.e2e import REQUIRED, launch, metrics
from tests.test_metrics_outputs import scalars


@pytest.fixture(scope="module")
def periodic_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("periodic")
    proc = launch(out, "--schedule", "periodic")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out.parent / f"{out.name}.console").write_text(proc.stdout + proc.stderr)  # beside the run dir
    return out


def test_run_outputs(periodic_run):
    rows = metrics(periodic_run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert REQUIRED <= row.keys(), REQUIRED - row.keys()
        assert row["trainer/tokens"] > 0 and row["tpspd"] > 0 and row["trainer/groups"] == 4
        # the paper's whole-run TPSPD: every token so far over the time since step 0 began, 3 ranks
        done = rows[:row["step"] + 1]
        run_s = row["trainer/push_end_t"] - rows[0]["generator/gen_start_t"]
        assert row["run_tpspd"] == pytest.approx(sum(r["trainer/tokens"] for r in done) / run_s / 3, rel=1e-9)
        assert row["trainer/logp_mismatch_max"] < 1e-4  # the trainer recomputes what the generator sampled
        assert row["trainer/ratio_mean"] == pytest.approx(1.0) and row["trainer/ratio_max"] == pytest.approx(1.0)  # one pass: on-policy
        assert row["trainer/staleness_mean"] == 0 and row["trainer/staleness_max"] == 0  # sampled by the weights it trains
        assert 0 < row["trainer/entropy"] < 6.3  # nats, below log(512) of the embedded vocabulary
    assert len({r["trainer/rollout_digest"] for r in rows}) == 3
    config = json.loads((periodic_run / "config.json").read_text())
    assert config["algo"] == "grpo" and config["algorithm"]["clip_low"] == 0.2 and config["steps"] == 3
    sources = config["_sources"]  # where each value came from
    assert sources["steps"] == "--steps" and sources["data.prompts_per_step"] == "--set"
    assert sources["trainer.lr"] == "default" and sources.keys() >= {"seed", "trainer.betas", "algorithm.clip_low"}
    model = AutoModelForCausalLM.from_pretrained(periodic_run / "final")
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert (periodic_run / "final" / "tokenizer.json").is_file()


def _same_run(a: Path, b: Path) -> None:
    assert [r["trainer/rollout_digest"] for r in metrics(a)] == [r["trainer/rollout_digest"] for r in metrics(b)]
    assert (a / "final/model.safetensors").read_bytes() == (b / "final/model.safetensors").read_bytes()


# evaluation at steps 0 and 2 on 8 held-out prompts, 2 samples each at T=1 (pass@2)
EVAL = ["--set", "eval.every=2", "--set", "eval.prompts=8", "--set", "eval.samples=2", "--set", "eval.temperature=1"]


def _eval_rows(out: Path) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in metrics(out)}


@pytest.fixture(scope="module")
def sync_eval_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync_eval")
    proc = launch(out, "--schedule", "sync", *EVAL, "--set", "logging.tensorboard=true", "--set", "logging.plots=true",
                  "--set", "logging.wandb=true", "--set", "logging.wandb_mode=offline")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out / "stderr.txt").write_text(proc.stderr)
    return out


def test_sync_equals_periodic_bit_for_bit(periodic_run, sync_eval_run):
    # the sync run also evaluates: evaluation changes no bit of training
    _same_run(periodic_run, sync_eval_run)


def test_samples_log(periodic_run):
    """samples.jsonl: every sample of every step, with what it was scored and its advantage."""
    lines = [json.loads(line) for line in (periodic_run / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt_index"], r["sample"]) for r in lines] == \
        [(s, i, j) for s in range(3) for i in range(4) for j in range(4)]
    for step, row in enumerate(metrics(periodic_run)):
        mine = [r for r in lines if r["step"] == step]
        assert sum(r["reward"] for r in mine) / 16 == pytest.approx(row["trainer/reward_mean"], abs=1e-6)
        assert sum(r["length"] for r in mine) / 16 == pytest.approx(row["trainer/response_len_mean"], abs=1e-6)
        for i in range(4):  # GRPO: a group's advantages are its rewards, centred (and scaled)
            group = [r for r in mine if r["prompt_index"] == i]
            assert sum(r["advantage"] for r in group) == pytest.approx(0, abs=1e-5)
            assert all(r["rewards"] == {"embedded": r["reward"]} for r in group)
    console = (periodic_run.parent / f"{periodic_run.name}.console").read_text()
    for step in range(3):  # one sample under each step's table: prompt 0's first response
        first = lines[16 * step]
        assert f"sample (prompt 0, reward {first['reward']:.3g}, advantage {first['advantage']:.3g}" in console
    assert console.count("\n  response: ") == 3
    # a log is no terminal: plain progress lines, no tqdm bar fragments between the tables
    assert "progress: 3/3 steps done, " in console and "it/s]" not in console and "\r" not in console
    import numpy as np

    # float32 values in their shortest form: 0.1, not 0.10000000149011612
    assert all(float(str(np.float32(r[k]))) == r[k] for r in lines for k in ("reward", "advantage"))
    for r in lines:
        assert 1 <= r["length"] <= 4 and (r["finished"] or r["length"] == 4)  # only EOS ends a sample early
        assert r["prompt"].endswith(" answer:") and isinstance(r["response"], str)


def test_evaluation_metrics(sync_eval_run):
    """eval/* at steps 0 and 2 only, equal to what eval_samples.jsonl holds."""
    evals = _eval_rows(sync_eval_run)
    assert not evals[1] and evals[0].keys() == evals[2].keys() == {
        "eval/reward_mean", "eval/pass@1", "eval/pass@2", "eval/response_len_mean", "eval/finished_frac", "eval/prompts"}
    lines = [json.loads(line) for line in (sync_eval_run / "eval_samples.jsonl").read_text().splitlines()]
    for step in (0, 2):
        mine = [r for r in lines if r["step"] == step]
        assert sorted((r["prompt_index"], r["sample"]) for r in mine) == [(i, j) for i in range(8) for j in range(2)]
        assert evals[step]["eval/prompts"] == 8
        assert evals[step]["eval/reward_mean"] == pytest.approx(sum(r["reward"] for r in mine) / 16, abs=1e-6)
        solved = {i: [r["reward"] >= 1.0 for r in mine if r["prompt_index"] == i] for i in range(8)}
        assert evals[step]["eval/pass@1"] == pytest.approx(sum(sum(s) / 2 for s in solved.values()) / 8)
        assert evals[step]["eval/pass@2"] == pytest.approx(sum(any(s) for s in solved.values()) / 8)
    board = scalars(sync_eval_run / "tensorboard")  # what TensorBoard shows
    assert board["trainer/loss"] == pytest.approx({s: r["trainer/loss"] for s, r in enumerate(metrics(sync_eval_run))},
                                                  rel=1e-6, abs=1e-12)  # stored as float32
    assert board["eval/pass@2"].keys() == {0, 2} and board["time/trainer_s"].keys() == {0, 1, 2}
    assert (sync_eval_run / "metrics.png").stat().st_size > 10_000
    train_prompts = {json.loads(line)["prompt"] for line in (sync_eval_run / "samples.jsonl").read_text().splitlines()}
    assert not train_prompts & {r["prompt"] for r in lines}  # held out


def test_wandb_offline_run_holds_the_rows_config_plots_and_samples(sync_eval_run):
    """logging.wandb: the W&B run (offline here, said at start) has every row's numbers under TensorBoard's keys,
    the resolved config, both plots and samples.jsonl as a table."""
    from tests.wandb_records import config, history

    run_id = (sync_eval_run / "wandb" / "run_id").read_text()
    assert f"tidal: W&B run {run_id} offline (logging.wandb_mode=offline) in {sync_eval_run / 'wandb'};" in (
        sync_eval_run / "stderr.txt").read_text()
    (run_dir,) = (sync_eval_run / "wandb").glob(f"offline-run-*-{run_id}")
    logged, rows = history(run_dir), metrics(sync_eval_run)
    assert sorted(logged) == [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert logged[row["step"]]["trainer/loss"] == row["trainer/loss"]  # JSON both ways: the same float
        assert logged[row["step"]]["time/trainer_s"] == row["trainer_s"]
    assert [s for s in logged if "eval/pass@2" in logged[s]] == [0, 2]
    assert {"plots/metrics/_type", "plots/timeline/_type", "samples/_type"} <= logged[2].keys()
    samples = (sync_eval_run / "samples.jsonl").read_text().splitlines()
    table = json.loads((run_dir / "files" / logged[2]["samples/path"]).read_text())
    assert len(table["data"]) == len(samples) and table["columns"][:3] == ["step", "prompt_index", "sample"]
    assert config(run_dir)["steps"] == 3 and config(run_dir)["schedule"]["kind"] == "sync"


def test_sync_equals_periodic_with_two_trainer_ranks(tmp_path):
    for schedule in ("sync", "periodic"):
        proc = launch(tmp_path / schedule, "--schedule", schedule, "--set", "trainer.dp=2", nproc=4)
        assert proc.returncode == 0, proc.stderr[-3000:]
    _same_run(tmp_path / "sync", tmp_path / "periodic")


def test_slow_reward_changes_timing_not_results(periodic_run, sync_eval_run, tmp_path):
    proc = launch(tmp_path, "--set", "reward.functions=[tests.rewards:slow_embedded]", *EVAL,
                  "--set", "logging.progress_every_s=0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_run(periodic_run, tmp_path)
    # the console from the start: connected, each executor ready (rank 0 sees its own line and the
    # others'), step 0 started, and while a slow step runs a line of what each executor is doing
    out = proc.stderr
    assert out.index("tidal: 3 ranks connected") < out.index("tidal: step 0 started") < out.index("reward_mean")
    assert all(f"tidal: {name} ready in " in out for name in ("generator", "reward", "trainer")), out[:3000]
    progress = [line for line in out.splitlines() if line.startswith("tidal: step ") and "into the run" in line]
    # a guest's work is its host's clause (the evaluation's two executors here run on the generator and the reward)
    assert progress and all("generator + eval_sampler: " in line and "reward + eval: " in line and "trainer: " in line
                            and "eval: starting" not in line for line in progress), progress
    assert any("scored" in line for line in progress), progress
    assert _eval_rows(tmp_path) == _eval_rows(sync_eval_run)  # evaluation is deterministic, whatever the schedule
    # periodic: the trainer starts on the first scored group while the others are still being scored.
    # Scoring a group takes >= 0.2 s here, so the check has >= 0.6 s of margin; a check against the
    # fast embedded reward raced the trainer's wake-up with a 7 ms generation tail and failed on CI.
    events = [json.loads(line) for f in sorted((tmp_path / "timeline").glob("rank*.jsonl"))
              for line in f.read_text().splitlines()]
    for step in range(1, 3):  # step 0: the trainer's one-time warm-up (first forward/backward)
        scored = [e["t1"] for e in events if e["step"] == step and e["kind"] == "scored"]
        trained = [e["t0"] for e in events if e["step"] == step and e["kind"] == "train"]
        assert len(scored) == 4 and len(trained) == 4
        assert min(trained) < max(scored), f"step {step}: training waited for the whole batch"
    for step in (0, 2):  # the evaluation (>= 16 x 0.05 s of scoring) runs beside the trainer's barrier
        barrier = next(e for e in events if e["step"] == step and e["kind"] == "barrier")
        eval_scored = [e["t1"] for e in events if e["step"] == step and e["kind"] == "eval_scored"]
        assert len(eval_scored) == 8 and barrier["t0"] < max(eval_scored), f"step {step}: the barrier waited"


def test_bad_data_file_names_file_and_line(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": 5}\n')
    proc = launch(tmp_path / "run", "--set", f"data.path={data}", steps=1, timeout=120)
    assert proc.returncode != 0
    # under torchrun every rank checks the file before it loads anything; rank 0 says so, once
    assert proc.stderr.count(f"error: data.path: {data}:2: field 'prompt'") == 1, proc.stderr[-2000:]


def test_raising_reward_names_reward_and_prompt(tmp_path):
    proc = launch(tmp_path, "--set", "reward.functions=[tests.rewards:boom]", steps=1, timeout=120)
    assert proc.returncode != 0
    assert "rank 1 (reward) failed: RewardError: reward 'tests.rewards:boom' failed on prompt" in proc.stderr
    assert "ZeroDivisionError: grader bug" in proc.stderr


def test_reward_errors_can_score_zero_and_count(tmp_path):
    proc = launch(tmp_path, "--set", "reward.functions=[tests.rewards:nan_sometimes]",
                  "--set", "reward.on_error=zero", steps=1, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = metrics(tmp_path)[0]
    # NaN for odd-length responses (scored 0 and counted), 1.0 otherwise: 16 samples in all
    assert row["trainer/reward_failures"] > 0
    assert row["trainer/reward_failures"] == round(16 * (1 - row["trainer/reward_mean"]))


@pytest.mark.parametrize("algo,extra", [
    ("dr_grpo", []), ("rloo", []), ("gspo", []), ("reinforce_pp", ["--set", "algorithm.baseline=true"]),
    ("dapo", ["--set", "algorithm.dynamic_sampling=false"]),
    ("grpo", ["--set", "algorithm.beta=0.05", "--set", "algorithm.kl_in=reward", "--set", "trainer.dp=2"]),
])
def test_every_algorithm_runs_end_to_end(tmp_path, algo, extra):
    proc = launch(tmp_path, *extra, nproc=4 if "trainer.dp=2" in extra else 3, steps=2, timeout=180,
                  algo=algo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert len(rows) == 2 and all(REQUIRED <= r.keys() for r in rows)
    assert all(r["trainer/grad_norm"] == r["trainer/grad_norm"] for r in rows)  # finite, not NaN
    assert json.loads((tmp_path / "config.json").read_text())["algo"] == algo


def test_several_optimizer_steps_per_batch_keep_schedules_identical(tmp_path):
    """PPO-style passes (2 mini-batches x 2 epochs) on 2 trainer ranks: periodic still equals sync."""
    opts = ["--set", "trainer.dp=2", "--set", "trainer.mini_batches=2", "--set", "trainer.epochs=2",
            "--set", "reward.functions=[tests.rewards:length_parity]"]  # dense: every pass has a signal
    for schedule in ("sync", "periodic"):
        proc = launch(tmp_path / schedule, "--schedule", schedule, *opts, nproc=4, steps=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
    _same_run(tmp_path / "sync", tmp_path / "periodic")
    rows = metrics(tmp_path / "periodic")
    assert all(r["trainer/optimizer_steps"] == 4 and r["trainer/clip_frac"] > 0 for r in rows)
    assert all(r["trainer/ratio_max"] > 1.0 and r["trainer/ratio_mean"] != 1.0 for r in rows)  # later passes move off-policy


def test_dynamic_sampling_tops_up_to_full_batches(tmp_path):
    """DAPO drops groups whose rewards are all equal and the generator samples more prompts with the
    same weights until B groups are kept: never a partial batch, and still sync == periodic."""
    for schedule in ("sync", "periodic"):
        # flat groups for half the prompts (dropped), dense rewards for the rest (kept)
        proc = launch(tmp_path / schedule, "--schedule", schedule, "--set",
                      "reward.functions=[tests.rewards:flat_for_half_the_prompts]", steps=2, algo="dapo")
        assert proc.returncode == 0, proc.stderr[-3000:]
    _same_run(tmp_path / "sync", tmp_path / "periodic")
    rows = metrics(tmp_path / "periodic")
    assert all(r["trainer/groups"] == 4 for r in rows)  # data.prompts_per_step
    assert any(r["generator/prompts_generated"] > 4 for r in rows)  # the untrained model does give flat groups
    assert all(r["trainer/reward_std"] > 0 for r in rows)


def test_shared_prompt_on_off_and_padded_train_the_same(tmp_path):
    """Packing changes how a group is laid out, not what is learned: the same rollouts, and weights
    that differ only by float32 summation order. Not bit-identical, and not within 1e-5 absolute:
    Adam's first update is lr*g/(|g|+eps), so entries whose gradient is within rounding noise of 0
    move by a sizeable fraction of lr either way (measured: max 1.4e-4 at lr 2e-3). The gradients
    themselves agree within 1e-5 (tests/test_packing.py, tests/test_trainer.py); here the weight
    difference is bounded relative to the update (measured 7.6e-5)."""
    import safetensors.torch
    import torch

    from tidal.modeling.hf import load_model

    for mode in ("on", "off", "padded"):
        proc = launch(tmp_path / mode, "--set", f"trainer.shared_prompt={mode}",  # a signal from step 0 on
                      "--set", "reward.functions=[tests.rewards:length_parity]", steps=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {mode: metrics(tmp_path / mode) for mode in ("on", "off", "padded")}
    assert len({tuple(r["trainer/rollout_digest"] for r in rows) for rows in runs.values()}) == 1
    assert runs["on"][0]["trainer/tokens"] < runs["off"][0]["trainer/tokens"]  # the prompt is trained once per group
    weights = {m: safetensors.torch.load_file(tmp_path / m / "final/model.safetensors") for m in runs}
    init = load_model(None, seed=0).state_dict()

    def norm(a, b):
        return torch.sqrt(sum(((a[n] - b[n]) ** 2).sum() for n in weights["on"])).item()

    update = norm(weights["on"], init)
    assert update > 1e-2  # two real steps
    for mode in ("off", "padded"):
        assert norm(weights["on"], weights[mode]) / update < 1e-3, mode
