"""The launch's choice of placement, schedule and slots (tidal/launch/auto.py): from the model with given
rates (a cache entry written here), by world size under torchrun, kept on resume, explicit settings
winning, the same bits as the fixed plan it picks, and what a run that strays from the plan is told."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tidal.launch import jobs
from tidal.launch.cli import auto_keys, parser, resolve
from tidal.launch import auto, cli
from tidal.launch.plan_watch import PlanWatch
from tidal.launch.measure import measure
from tests.e2e import max_abs_diff, weights


def _resolve(*argv: str, rates: str = "cached"):
    return resolve(parser().parse_args(["--algo", "grpo", *argv]), rates=rates)


def at(*, gen: float, train: float, row: float | None = None) -> dict:
    """Rates at one thread count: a decode forward's fixed part (and per row), a trained token's cost."""
    return {"gen": {"forward_s": gen, "row_s": gen / 50 if row is None else row, "prefill_token_s": 0.0},
            "train": {"group_s": 0.0, "token_s": train, "barrier_s": 0.01, "copy_s": 0.001}}


SPLIT, COLOCATED = auto.threads_for(3), auto.threads_for(1)  # the threads of a rank
FAST_SECOND_THREAD = {"split": at(gen=0.02, train=1e-3), "colocated": at(gen=0.01, train=5e-4)}  # a 0.5B model
NO_SECOND_THREAD = {"split": at(gen=0.02, train=1e-3), "colocated": at(gen=0.02, train=1e-3)}  # the embedded one
# a hundred times slower again: a run on any machine, under any load, is far off them (test_the_choice_changes_no_bit)
FAR_TOO_SLOW = {"split": at(gen=2.0, train=0.1), "colocated": at(gen=1.0, train=0.05)}
two_cores = pytest.mark.skipif(SPLIT == COLOCATED, reason="a split rank and a co-located one get the same threads")


def _cache(cfg, rates: dict, *, prompt_len: int = 20) -> None:
    """Cache entries as tidal/launch/auto.py writes them (one per thread count), for the job `cfg` on this machine."""
    threads = {"split": SPLIT, "colocated": COLOCATED}
    spec = auto.measure_spec(cfg, threads=[threads[p] for p in rates])
    auto.cache_dir().mkdir(parents=True, exist_ok=True)
    for placement, r in rates.items():
        entry = {"prompt_len": prompt_len, "measure_s": 1.0, "rates": {str(threads[placement]): r}}
        auto.entry_path(spec, threads[placement]).write_text(json.dumps(entry))


@pytest.fixture(autouse=True)
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TIDAL_THREADS", raising=False)


@two_cores
def test_the_rates_decide_between_colocated_and_split():
    cfg = _resolve()  # no rates cached: the rule, as before
    assert (cfg.placement, cfg.schedule.kind) == ("split", "periodic") and cfg.sources["placement"] == "auto"
    assert "no rates measured" in cfg.auto.basis
    # products that run twice as fast on two threads (a 0.5B model): one process with both cores wins
    _cache(cfg, FAST_SECOND_THREAD)
    cfg = _resolve()
    assert (cfg.placement, cfg.schedule.kind) == ("colocated", "sync"), cfg.auto.lines()
    assert cfg.auto.chosen.step_s == min(o.step_s for o in cfg.auto.options)
    assert {(o.placement, o.schedule) for o in cfg.auto.options} == {("colocated", "sync"), ("split", "periodic"),
                                                                     ("split", "sync")}
    # a model too small for a second thread to help (the embedded one): overlap on split ranks wins
    _cache(cfg, NO_SECOND_THREAD)
    cfg = _resolve()
    assert (cfg.placement, cfg.schedule.kind) == ("split", "periodic"), cfg.auto.lines()
    line = cfg.auto.lines()[1]
    assert "<- chosen" in line and "colocated sync" in line and "split sync" in line


@two_cores
def test_explicit_settings_win_and_auto_is_the_same_as_unset():
    _cache(_resolve(), FAST_SECOND_THREAD)
    cfg = _resolve("--set", "placement=split")
    assert (cfg.placement, cfg.schedule.kind) == ("split", "periodic") and cfg.sources["placement"] == "--set"
    assert set(cfg.auto.settings) == {"schedule.kind"}
    cfg = _resolve("--schedule", "periodic")  # co-located cannot run periodic: split is the only plan
    assert cfg.placement == "split" and "only plan" in cfg.auto.basis
    cfg = _resolve("--set", "placement=auto", "--set", "schedule=auto")
    assert (cfg.placement, cfg.schedule.kind) == ("colocated", "sync")
    assert _resolve("--set", "placement=colocated", "--schedule", "sync").auto is None
    assert auto_keys({"placement": "split", "schedule": {"kind": "auto"}}) == {"schedule.kind"}


@two_cores
def test_under_torchrun_the_world_size_decides(monkeypatch):
    _cache(_resolve(), FAST_SECOND_THREAD)  # co-located would win
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert _resolve().placement == "split"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _resolve().placement == "colocated"


@pytest.mark.parametrize("rates, more", [(at(gen=0.05, train=1e-4), "replicas"), (at(gen=1e-3, train=2e-2), "dp")])
def test_several_accelerators_are_filled_with_the_split_the_planner_favours(monkeypatch, rates, more):
    """On a machine of 8 accelerators (told to the launch: this one has none), generator.replicas and
    trainer.dp left unset are chosen with the plan: every device a rank (the reward's one of them), the
    generator's side larger where decoding costs most, the trainer's where training does, and the split
    `--plan --devices 8` rates best (tidal/planner/plan.py splits) on the same rates."""
    from tidal.planner.plan import splits

    job = ("--set", "placement=split")
    cfg = _resolve(*job)  # one accelerator's view: the layout as configured, whose spec the rates are cached under
    threads = auto.threads_for(8)
    spec = auto.measure_spec(cfg, threads=[threads])
    auto.cache_dir().mkdir(parents=True, exist_ok=True)
    auto.entry_path(spec, threads).write_text(json.dumps({"prompt_len": 20, "measure_s": 1.0,
                                                           "rates": {str(threads): rates}}))
    monkeypatch.setattr(cli, "accelerators", lambda: 8)
    chosen = _resolve(*job)
    assert chosen.generator.replicas + 1 + chosen.trainer.dp == 8, chosen.auto.lines()
    assert chosen.sources["generator.replicas"] == chosen.sources["trainer.dp"] == "auto"
    r, d = chosen.generator.replicas, chosen.trainer.dp
    assert (r > d) if more == "replicas" else (d > r), chosen.auto.lines()
    assert f"{r} generator replica{'s' * (r > 1)} + trainer dp {d}" in chosen.auto.lines()[1]
    shape = auto.step_shape(cfg, prompt_len=20, slots=cfg.generator.max_batch_prompts)
    planned = splits([shape], auto.rates_at({"rates": {str(threads): rates}}, threads, placement="split",
                                            device="cpu"), devices=8, other_devices=1)
    fastest = min(planned, key=lambda s: min(s.sync_s, s.periodic_s))
    assert (fastest.replicas, fastest.dp) == (r, d)
    assert chosen.auto.chosen.step_s == pytest.approx(min(fastest.sync_s, fastest.periodic_s), rel=1e-9)
    # one of the two set: the other keeps its default, as on a machine of one device
    one = _resolve(*job, "--set", "trainer.dp=2")
    assert (one.generator.replicas, one.trainer.dp) == (1, 2) and "generator.replicas" not in one.auto.settings
    monkeypatch.setattr(cli, "accelerators", lambda: 0)  # a CPU machine: its ranks share its cores, nothing to fill
    assert "trainer.dp" not in _resolve(*job).auto.settings


def test_waves_only_where_they_pay(tmp_path):
    model = tmp_path / "model"
    from tidal.modeling.hf import load_model, load_tokenizer, save_hf

    save_hf(load_model(None), load_tokenizer(None), model)
    job = ("--set", f"model.path={model}", "--set", "placement=split", "--set", "data.prompts_per_step=8",
           "--set", "generator.samples_per_prompt=4", "--set", "generator.max_new_tokens=32")
    cfg = _resolve(*job)
    assert cfg.sources["generator.max_batch_prompts"] == "auto"
    # decoding a row costs little beside a forward's fixed part, training is as long as decoding: waves
    # cost more forwards than the overlap wins, so one wave
    _cache(cfg, {"split": at(gen=0.05, train=2e-4)})
    cfg = _resolve(*job)
    assert cfg.generator.max_batch_prompts == 8, cfg.auto.lines()
    # rows cost as much as the fixed part (a forward bound by its rows): waves cost nothing and overlap
    _cache(cfg, {"split": at(gen=0.0, row=0.01, train=2e-3)})
    cfg = _resolve(*job)
    assert cfg.generator.max_batch_prompts < 8 and cfg.schedule.kind == "periodic", cfg.auto.lines()


def test_a_resume_keeps_the_runs_choice(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"placement": "colocated", "schedule": {"kind": "sync"}}))
    cfg = _resolve("--output-dir", str(out), "--resume")
    assert (cfg.placement, cfg.schedule.kind) == ("colocated", "sync") and cfg.auto.basis == "as the resumed run chose"


@two_cores
def test_a_run_off_its_plan_is_told_which_plan_its_rates_favour():
    _cache(_resolve(), NO_SECOND_THREAD)
    cfg = _resolve()
    chosen, said = cfg.auto.chosen, []
    assert chosen.placement == "split"
    watch = PlanWatch(cfg, cfg.auto, say=said.append)
    for _ in range(1 + auto.OFF_FOR - 1):  # the first step warms up; then one short of saying it
        watch.observe(step_s=2 * chosen.step_s, gen_s=chosen.gen_s, train_s=4 * chosen.train_s)
    assert said == []
    watch.observe(step_s=chosen.step_s, gen_s=chosen.gen_s, train_s=chosen.train_s)  # on plan: the count restarts
    for _ in range(auto.OFF_FOR):
        watch.observe(step_s=2 * chosen.step_s, gen_s=chosen.gen_s, train_s=4 * chosen.train_s)
    assert len(said) == 1 and "2.00x the plan's" in said[0] and "training 4.00x" in said[0], said
    assert "--set" in said[0] or "still stands" in said[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the engine's fp32 head is its own
def test_the_measurement_times_the_real_engine_and_trainer_model(dtype):
    spec = {"model_path": None, "gen_dtype": dtype, "train_dtype": dtype, "samples": 4, "groups": 2,
            "response_tokens": 8, "extra_forwards": 0, "threads": [1],
            "trainer": {"shared_prompt": "auto", "token_budget": 4096, "micro_batch_size": 8, "logprob_chunk": 1024},
            "data": {"path": None, "prompt_key": "prompt", "chat_template": False, "max_prompt_tokens": 256,
                     "prompts": 4, "seed": 0, "embedded_prompts": 64}}
    threads = torch.get_num_threads()
    try:
        out = measure(spec)
    finally:
        torch.set_num_threads(threads)
    from tidal.modeling.hf import load_tokenizer
    from tidal.modeling.tiny.task import embedded_prompts
    from tidal.executors.data import PromptRow, PromptSet

    prompts = PromptSet([PromptRow(prompt=p["prompt"], extras={}) for p in embedded_prompts(64, seed=0)],
                        tokenizer=load_tokenizer(None), max_prompt_tokens=256, apply_chat_template=False)
    step = prompts.prompts(0, range(4), batch_size=4, seed=0, max_topups=0)
    assert out["prompt_len"] == round(sum(len(ids) for _, _, ids in step) / 4)
    r = out["rates"]["1"]
    assert r["gen"]["forward_s"] + r["gen"]["row_s"] > 0 and r["train"]["token_s"] + r["train"]["group_s"] > 0
    assert r["train"]["barrier_s"] > 0 and r["train"]["copy_s"] > 0


def test_rates_measured_on_a_busy_machine_serve_one_launch_and_are_not_cached():
    """A process spinning on each of the measurement's cores: the rates come back with the share of the cores
    others kept busy, and nothing is cached (a busy machine's rates once picked a plan 2x slower). A
    function's own threads are not counted as others'."""
    from tidal.launch.measure import others_share

    def work():  # half a second: /proc/stat counts in 10 ms ticks
        a, end = torch.randn(256, 256), time.perf_counter() + 0.5
        while time.perf_counter() < end:
            a = torch.tanh(a @ a)

    quiet = others_share(work)[1]
    spec = {"model_path": None, "gen_dtype": "float32", "train_dtype": "float32", "samples": 2, "groups": 1,
            "response_tokens": 4, "extra_forwards": 0, "threads": [1],
            "trainer": {"shared_prompt": "auto", "token_budget": 4096, "micro_batch_size": 8, "logprob_chunk": 1024},
            "data": {"path": None, "prompt_key": "prompt", "chat_template": False, "max_prompt_tokens": 256,
                     "prompts": 1, "seed": 0, "embedded_prompts": 64}}
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]
    try:
        measured = auto.measured_rates(spec)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()
    assert measured["others_share"] > auto.BUSY_SHARE and measured["rates"]["1"]["train"]["token_s"] > 0
    assert auto.cached_rates(spec) is None
    assert "not cached: other processes kept" in auto.measured_basis(measured)  # the choice's first line
    # the function's own threads (both cores busy) are not counted: far below the spinners' share, whatever
    # else this machine runs
    assert quiet < measured["others_share"] - auto.BUSY_SHARE, (quiet, measured["others_share"])


def test_the_barrier_and_copy_are_timed_over_a_part_of_the_parameters():
    """part_of: parameters in order, skipping one that would overflow the part (a 0.5B model's embedding), the
    smallest alone where none fits; what is timed over it is scaled by the whole's count (bench-checked on
    Qwen2.5-0.5B and SmolLM2: 0.86-1.06x the whole's time, docs/running.md)."""
    from tidal.launch.measure import part_of

    sizes = [100, 30, 50, 10, 20]
    params = [torch.empty(n) for n in sizes]
    assert [p.numel() for p in part_of(params, most=60)] == [30, 10, 20]
    assert [p.numel() for p in part_of(params, most=1000)] == sizes
    assert [p.numel() for p in part_of(params, most=5)] == [10]


@two_cores
def test_the_choice_changes_no_bit(tmp_path):
    """The launch's choice (co-located here, from the cached rates) is the fixed plan, set by hand; and
    the run, many times faster than these made-up rates predict, is told so once."""
    _cache(_resolve(), FAR_TOO_SLOW)
    steps = 1 + auto.OFF_FOR  # the first step warms up
    chosen = jobs.run("grpo", overrides={"logging.plots": False}, steps=steps, output_dir=tmp_path / "auto")
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    assert "tidal: auto: placement=colocated schedule.kind=sync" in chosen.stderr
    assert chosen.stderr.count(f"tidal: auto: the last {auto.OFF_FOR} steps took") == 1, chosen.stderr[-3000:]
    # the plan set by hand, its one rank forked by the warm launcher (as torchrun --nproc-per-node 1 runs it)
    fixed = jobs.run("grpo", overrides={"logging.plots": False, "placement": "colocated", "schedule": "sync"},
                     steps=steps, output_dir=tmp_path / "fixed", nproc=1)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert "tidal: auto" not in fixed.stderr
    recorded = json.loads(Path(tmp_path / "auto" / "config.json").read_text())
    assert recorded["_sources"]["placement"] == "auto" and recorded["placement"] == "colocated"
    assert max_abs_diff(weights(tmp_path / "auto" / "final"), weights(tmp_path / "fixed" / "final")) == 0.0
