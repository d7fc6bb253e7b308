"""The placement planner (tidal/planner/): its step model against step times computed by hand, its
calibration against a run whose timeline the model itself wrote, and `launch.py --plan`."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.launch.cli import main as cli_main
from tidal.planner.calibrate import calibrate, fit_concurrency
from tidal.planner.model import GenFeatures, GenRates, Rates, StepShape, TrainRates, replay_engine, simulate
from tidal.planner.plan import colocated, load_rates, slot_choices, slots_table, splits, table, trainer_unit

ROOT = Path(__file__).resolve().parents[1]


def _shape(*, B=8, G=4, L=5, P=3, mbp=8, **kw) -> StepShape:
    return StepShape(prompt_lens=(P,) * B, lengths=((L,) * G,) * B, max_batch_prompts=mbp, **kw)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("token_s", [0.01, 0.1])  # training lighter / heavier than a chunk's generation
def test_sync_and_periodic_by_hand_with_the_1_over_k_tail(k, token_s):
    """B prompts in k chunks, every response L tokens: a chunk takes c = (L-1) decode forwards plus
    its prefill, and its groups leave together. Sync trains after all k chunks; periodic trains
    chunk j while chunk j+1 decodes, so only the last chunk's training (1/k of it) is left after
    generation, unless training is the slower side (then it runs from the first chunk on)."""
    B, G, L, P, f, barrier = 8, 4, 5, 3, 0.1, 0.5
    shape = _shape(B=B, G=G, L=L, P=P, mbp=B // k)
    rates = Rates(gen=GenRates(forward_s=f), train=TrainRates(token_s=token_s, barrier_s=barrier))
    c, T_train = f * L, B * (P + G * L) * token_s  # L - 1 decode forwards + 1 prefill per chunk
    sync = simulate(shape, rates, schedule="sync")
    periodic = simulate(shape, rates, schedule="periodic")
    assert sync.step_s == pytest.approx(k * c + T_train + barrier)
    assert periodic.step_s == pytest.approx(max(k * c + T_train / k, c + T_train) + barrier)
    assert sync.gen_s == periodic.gen_s == pytest.approx(k * c)
    assert periodic.first_train_s == pytest.approx(c) and sync.first_train_s == pytest.approx(k * c)


def test_overlap_on_shared_hardware_runs_at_the_concurrency_factor():
    """Two groups, 1 s of generation and 1 s of training each. With separate devices: g0 alone
    0-1, then g1's generation beside g0's training 1-2, then g1's training 2-3. With each at half
    speed while both run (one core): the overlap takes 2 s, so periodic gains nothing."""
    shape = StepShape(prompt_lens=(1, 1), lengths=((2,), (2,)), max_batch_prompts=1)  # prefill + 1 decode forward
    train = TrainRates(group_s=1.0)
    separate = Rates(gen=GenRates(forward_s=0.5), train=train, concurrency=1.0)
    shared = Rates(gen=GenRates(forward_s=0.5), train=train, concurrency=0.5)
    assert simulate(shape, separate, schedule="periodic").step_s == pytest.approx(3.0)
    assert simulate(shape, shared, schedule="periodic").step_s == pytest.approx(4.0)
    assert simulate(shape, shared, schedule="sync").step_s == pytest.approx(4.0)


def test_replicas_dp_reward_and_handoff_by_hand():
    """4 prompts, one at a time (c = 1 s each): 2 replicas take prompts 0,2 and 1,3 and finish at
    2 s; 2 trainer units take even and odd indices. Each group then spends 0.1 s in the reward
    (one server, FIFO) and 0.05 s on the way."""
    shape = StepShape(prompt_lens=(1,) * 4, lengths=((2,),) * 4, max_batch_prompts=1, replicas=2, dp=2)
    rates = Rates(gen=GenRates(forward_s=0.5), train=TrainRates(group_s=1.0, barrier_s=0.2, push_s=0.3),
                  reward_group_s=0.1, handoff_s=0.05)
    # sync: groups 2 and 3 leave at 2.0; the reward scores them by 2.1 and 2.2; delivered at 2.25
    assert simulate(shape, rates, schedule="sync").step_s == pytest.approx(2.25 + 2 * 1.0 + 0.5)
    # periodic: each unit trains its first group from 1.15/1.25 and its second from 2.15/2.25
    p = simulate(shape, rates, schedule="periodic")
    assert p.first_train_s == pytest.approx(1.15) and p.step_s == pytest.approx(3.25 + 0.5)
    assert p.overlap_s == pytest.approx(2.0 - 1.15)


def test_continuous_admission_replays_the_slots():
    """Group lengths 3, 10, 3, 3 with 2 slots: chunked waits for the 10 before admitting two more;
    continuous refills the first slot at once, so groups 2 and 3 leave before group 1."""
    prompts = [(i, 2, 2, n) for i, n in enumerate((3, 10, 3, 3))]
    chunked = [i for i, _ in replay_engine(prompts, max_batch_prompts=2, admission="chunked")]
    continuous = [i for i, _ in replay_engine(prompts, max_batch_prompts=2, admission="continuous")]
    assert chunked == [0, 1, 2, 3] and continuous == [0, 2, 3, 1]
    work = [w for _, w in replay_engine(prompts, max_batch_prompts=2, admission="chunked")]
    total = GenFeatures()
    for w in work:
        total = total + w
    # chunk 1: prefill + 9 decode forwards (4 rows for 2, then 2 rows); chunk 2: prefill + 2 of 4 rows
    assert (total.forwards, total.rows, total.sends) == (2 + 9 + 2, 4 * 2 + 2 * 7 + 4 * 2, 4)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="admission"):
        _shape(admission="eager")
    with pytest.raises(ValueError, match="one entry per prompt"):
        StepShape(prompt_lens=(1,), lengths=(), max_batch_prompts=1)
    with pytest.raises(ValueError, match="schedule"):
        simulate(_shape(), Rates(gen=GenRates(), train=TrainRates()), schedule="async")


def _write_run(run: Path, shape: StepShape, rates: Rates, *, steps: int = 3) -> None:
    """A sync run's records as the job writes them, with every time taken from the model: the
    calibration must find the rates back."""
    (run / "timeline").mkdir(parents=True)
    cfg = {"generator": {"max_batch_prompts": shape.max_batch_prompts, "admission": shape.admission, "replicas": 1,
                         "engine": "native", "samples_per_prompt": len(shape.lengths[0])},
           "trainer": {"dp": 1, "shared_prompt": "auto"}}
    (run / "config.json").write_text(json.dumps(cfg))
    samples, metrics, gen_ev, trn_ev, rwd_ev = [], [], [], [], []
    for step in range(steps):
        t0 = 1000.0 * (step + 1)
        gen_ev.append({"executor": "generator", "rank": 0, "step": step, "kind": "generate", "t0": t0, "t1": t0})
        done = GenFeatures()
        for index, work in shape.replay(range(len(shape.lengths))):
            done = done + work
            gen_ev.append({"executor": "generator", "rank": 0, "step": step, "kind": "generated",
                           "t0": t0 + rates.gen.cost(done), "t1": t0 + rates.gen.cost(done), "index": index})
        t = max(e["t0"] for e in gen_ev if e["step"] == step) + rates.reward_group_s + rates.handoff_s
        rwd_ev.append({"executor": "reward", "rank": 1, "step": step, "kind": "scored", "t0": t0,
                       "t1": t0 + rates.reward_group_s, "index": 0})
        for i in range(len(shape.lengths)):
            dt = rates.train.cost(shape.group_tokens(i), len(shape.lengths[i]))
            trn_ev.append({"executor": "trainer", "rank": 2, "step": step, "kind": "train", "t0": t, "t1": t + dt,
                           "index": i})
            t += dt
        trn_ev.append({"executor": "trainer", "rank": 2, "step": step, "kind": "push", "t0": t + rates.train.barrier_s,
                       "t1": t + rates.train.barrier_s + rates.train.push_s})
        for i, lengths in enumerate(shape.lengths):
            samples += [{"step": step, "prompt_index": i, "sample": j, "length": n} for j, n in enumerate(lengths)]
        metrics.append({"step": step, "trainer/tokens": sum(shape.group_tokens(i) for i in range(len(shape.lengths))),
                        "step_s": t + rates.train.barrier_s + rates.train.push_s - t0})
    for name, events in (("rank000", gen_ev), ("rank001", rwd_ev), ("rank002", trn_ev)):
        (run / "timeline" / f"{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


def test_calibration_finds_the_rates_of_a_run_back(tmp_path):
    """Two runs of different lengths and group sizes (so a group's fixed, per-sample and per-token
    costs come apart), each with uneven groups under continuous admission (so rows per forward,
    contexts and joins vary)."""
    gen = GenRates(forward_s=2e-3, row_s=3e-5, row_col_s=2e-7, send_s=1e-3, join_cell_s=5e-6)
    rates = Rates(gen=gen, train=TrainRates(group_s=0.01, sample_s=0.002, token_s=1e-4, barrier_s=0.02, push_s=0.003),
                  reward_group_s=0.001, handoff_s=0.004)
    for name, lengths, P, G in (("a", (3, 9, 5, 7, 4, 8), 6, 3), ("b", (20, 11, 30, 16, 25, 12), 9, 2)):
        shape = StepShape(prompt_lens=(P,) * 6, lengths=tuple((n,) + (1,) * (G - 1) for n in lengths),
                          max_batch_prompts=2, admission="continuous")
        _write_run(tmp_path / name, shape, rates)
    found = calibrate(tmp_path / "a", tmp_path / "b")
    for got, want in ((found.gen.forward_s, 2e-3), (found.gen.row_s, 3e-5), (found.gen.row_col_s, 2e-7),
                      (found.gen.send_s, 1e-3), (found.gen.join_cell_s, 5e-6), (found.train.sample_s, 0.002),
                      (found.train.group_s, 0.01), (found.train.token_s, 1e-4), (found.train.barrier_s, 0.02),
                      (found.train.push_s, 0.003), (found.reward_group_s, 0.001), (found.handoff_s, 0.004)):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
    # a periodic run measured at 0.6 concurrency: the fit finds it back from the step time alone
    slow = Rates(gen=rates.gen, train=rates.train, reward_group_s=0.001, handoff_s=0.004, concurrency=0.6)
    periodic = tmp_path / "p"
    _write_run(periodic, StepShape(prompt_lens=(6,) * 6, lengths=tuple((n, 1) for n in (20, 11, 30, 16, 25, 12)),
                                   max_batch_prompts=2, admission="continuous"), rates)
    step_s = simulate(StepShape(prompt_lens=(6,) * 6, lengths=tuple((n, 1) for n in (20, 11, 30, 16, 25, 12)),
                                max_batch_prompts=2, admission="continuous"), slow, schedule="periodic").step_s
    rows = [dict(json.loads(line), step_s=step_s) for line in (periodic / "metrics.jsonl").read_text().splitlines()]
    (periodic / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert fit_concurrency(found, periodic) == pytest.approx(0.6, abs=0.011)


def test_splits_table_recommends_the_fastest_periodic_split():
    """Generation needs 4 replica-seconds, training 4 unit-seconds: with 4 devices the 2/2 split
    balances them, and periodic overlaps them."""
    shape = StepShape(prompt_lens=(1,) * 8, lengths=((2,),) * 8, max_batch_prompts=1)
    rates = Rates(gen=GenRates(forward_s=0.25), train=TrainRates(group_s=0.5))
    rows = splits([shape], rates, devices=4)
    assert [(r.gen_devices, r.train_devices) for r in rows] == [(1, 3), (2, 2), (3, 1)]
    two = rows[1]
    assert (two.sync_s, two.periodic_s) == (pytest.approx(4.0), pytest.approx(2.5))
    text = table(rows, devices=4)
    best = [line for line in text.splitlines() if "<- use" in line]
    assert len(best) == 1 and best[0].split()[:2] == ["2", "2"]


@pytest.mark.parametrize("swap_s, use", [(0.25, "co-located"), (1.0, "split")])
def test_colocated_row_wins_until_its_swap_costs_more_than_the_overlap_saves(swap_s, use):
    """The same 4 devices co-located: generation on 4 replicas (1 s), training on 4 units (1 s), in
    turn, plus the swap; the best split (2/2, periodic) takes 2.5 s. A 0.25 s swap (2.25 s) beats it,
    a 1 s swap (3 s) does not."""
    shape = StepShape(prompt_lens=(1,) * 8, lengths=((2,),) * 8, max_batch_prompts=1)
    rates = Rates(gen=GenRates(forward_s=0.25), train=TrainRates(group_s=0.5), swap_s=swap_s)
    together = colocated([shape], rates, devices=4)
    assert (together.replicas, together.dp, together.step_s) == (4, 4, pytest.approx(2.0 + swap_s))
    best = [line for line in table(splits([shape], rates, devices=4), devices=4, together=together).splitlines()
            if "<- use" in line]
    assert len(best) == 1 and ("(co-located)" in best[0]) == (use == "co-located")
    assert colocated([shape], rates, devices=3, gen_tp=2) is None  # 3 devices hold no whole tp-2 replicas


@pytest.mark.parametrize("rows_cost, want", [(False, 4), (True, 1)])
def test_admission_recommendation_follows_what_a_row_costs(rows_cost, want):
    """4 prompts x 4 samples, every sample at the 10-token cap. If a forward costs the same for any
    number of rows and training is light, waves only add forwards: all 4 groups at once. If the cost is
    all per row, waves cost nothing and each lets the trainer start earlier: one group at a time,
    and then training runs beside all but the first group's generation."""
    shape = _shape(B=4, G=4, L=10, P=2, mbp=4)
    gen = GenRates(row_s=0.01) if rows_cost else GenRates(forward_s=0.1)
    rates = Rates(gen=gen, train=TrainRates(token_s=0.01 if rows_cost else 1e-4))
    rows = slot_choices([shape], rates, replicas=1, dp=1)
    assert [r.slots for r in rows] == [1, 2, 4]
    assert rows[-1].overlap_s == 0.0  # all at the cap together: nothing leaves before the end
    assert min(rows, key=lambda r: r.periodic_s).slots == want
    if rows_cost:  # a group: 9 decode forwards (the prefill gives token 1) x 4 rows x 0.01 s = 0.36 s,
        # trained in 42 tokens x 0.01 s = 0.42 s: training is the longer side from the first group on
        assert rows[0].periodic_s == pytest.approx(0.36 + 4 * 0.42)
        assert rows[0].overlap_s == pytest.approx(3 * 0.36)
    split = splits([shape], rates, devices=2)[0]
    text = slots_table([shape], rates, split, samples=4)
    assert f"--set generator.max_batch_prompts={want}," in text.splitlines()[0]
    assert f"--set generator.vllm.max_num_seqs={want * 4}," in slots_table([shape], rates, split, samples=4,
                                                                          engine="vllm").splitlines()[0]


def test_paper_scale_rates_file_gives_a_table():
    rates, shapes, layout = load_rates(ROOT / "configs" / "plan-qwen3-8b-16npu.yaml")
    assert layout["devices"] == 16 and len(shapes[0].lengths) == 32
    rows = splits(shapes, rates, devices=16, gen_tp=layout["gen_tp"], train_unit=layout["train_tp"],
                  other_devices=layout["other_devices"])
    assert rows and all(r.gen_devices % 2 == 0 and r.train_devices % 4 == 0 for r in rows)
    assert all(r.periodic_s <= r.sync_s for r in rows)


def test_pipeline_stages_make_a_trainer_unit_tp_x_pp_devices(tmp_path):
    """trainer.pp: a split's trainer is whole units of tp x pp devices (layout.train_pp in a rates file)."""
    import yaml

    data = yaml.safe_load((ROOT / "configs" / "plan-qwen3-8b-16npu.yaml").read_text())
    data["layout"] |= {"train_tp": 2, "train_pp": 2}
    data["step"] |= {"prompts": 4, "lengths": [1200, 4000]}  # a short step: the splits are what is checked
    path = tmp_path / "rates.yaml"
    path.write_text(yaml.safe_dump(data))
    rates, shapes, layout = load_rates(path)
    assert trainer_unit(layout) == 4
    rows = splits(shapes, rates, devices=16, gen_tp=2, train_unit=trainer_unit(layout), other_devices=2)
    assert {r.train_devices for r in rows} == {4, 8, 12} and all(r.dp == r.train_devices // 4 for r in rows)


def test_plan_flags_are_checked(capsys):
    assert cli_main(["--algo", "grpo", "--devices", "4"]) == 2
    assert "--devices and --rates go with --plan" in capsys.readouterr().err
    assert cli_main(["--algo", "grpo", "--plan", "--devices", "1"]) == 2
    assert "--devices must be 2 or more" in capsys.readouterr().err
    assert cli_main(["--algo", "grpo", "--plan", "--rates", "nowhere.yaml"]) == 2
    assert "nowhere.yaml" in capsys.readouterr().err


def test_plan_calibrates_the_job_on_this_machine():
    """`--plan` as a user runs it: three 5-step calibration runs of the embedded job (sync, periodic,
    co-located), then the table: every split and the co-located placement; the admission and the partial
    rollouts for the marked split."""
    proc = subprocess.run([sys.executable, "launch.py", "--algo", "grpo", "--plan", "--devices", "3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "calibrated on this machine" in proc.stdout
    splits_text, admission = proc.stdout.split("\n\ngenerator admission for ")
    admission, partial = admission.split("\n\npartial rollouts for ")
    # partial rollouts on the same split: whole, then an eighth, a quarter and a half of max_new_tokens (the job's 8)
    budgets = [line.split() for line in partial.splitlines()[3:]]
    assert [b[0] for b in budgets] == ["whole", "1", "2", "4"] and sum(b[-1] == "use" for b in budgets) == 1
    assert float(budgets[0][4]) == 1.0 and float(budgets[0][5]) == 0 < float(budgets[1][5])  # vs whole, staleness
    lines = [line for line in splits_text.splitlines() if line.strip()[:1].isdigit()]
    assert [line.split()[:2] for line in lines] == [["1", "2"], ["2", "1"], ["3", "(co-located)"]]
    assert float(lines[-1].split()[5]) > 0  # its sync step s (swap included)
    lines = lines[:-1]
    # for the marked split, the embedded job's B=8 prompts over its replicas: 1, 2 (as run), 4 and,
    # on one replica, 8 groups at once; one marked
    head, *table_lines = admission.splitlines()
    assert re.match(r"[12] generator / [12] trainer devices", head) and "--set generator.max_batch_prompts=" in head
    rows = [line.split() for line in table_lines if line.strip()[:1].isdigit()]
    want = ["1", "2", "4", "8"] if head.startswith("1 generator") else ["1", "2", "4"]
    assert [r[0] for r in rows] == want and sum(r[-1] == "use" for r in rows) == 1
    assert sum("<- use" in line for line in splits_text.splitlines()) == 1
    for line in lines:
        sync_s, periodic_s = float(line.split()[4]), float(line.split()[5])
        assert 0.01 < periodic_s <= sync_s < 10


@pytest.mark.parametrize("group_s", [0.05, 0.2])  # generation-bound, then training-bound
def test_offpolicy_model_pipelines_steps(group_s):
    """max_lag=0 repeats the periodic step; max_lag=1 lets the generator run on through the
    trainer's tail and barrier, so a step costs the busier side alone: the generator's whole step,
    or the trainer's groups back to back plus its barrier."""
    from tidal.planner.model import simulate_offpolicy

    shape = StepShape(prompt_lens=(8,) * 8, lengths=tuple((16,) * 4 for _ in range(8)), max_batch_prompts=2)
    rates = Rates(gen=GenRates(forward_s=0.01, row_s=0.001), reward_group_s=0.001,
                  train=TrainRates(group_s=group_s, token_s=0.001, barrier_s=0.05, push_s=0.02))
    periodic = simulate(shape, rates, schedule="periodic")
    assert simulate_offpolicy([shape] * 6, rates, max_lag=0) == pytest.approx([periodic.step_s] * 6)
    lag1 = simulate_offpolicy([shape] * 6, rates, max_lag=1)
    train = 8 * rates.train.cost(shape.group_tokens(0), 4) + rates.train.barrier_s + rates.train.push_s
    assert lag1[0] == pytest.approx(periodic.step_s)  # the pipeline fills
    assert lag1[1:] == pytest.approx([max(periodic.gen_s, train)] * 5)
    assert max(periodic.gen_s, train) < periodic.step_s


# ---- partial rollouts (tidal/planner/partial.py) ------------------------------------------------------
def test_partial_rollouts_by_hand():
    """B=2 prompts of one sample, lengths 2 and 6, budget 2, one forward = 1 s and nothing else costs: step 0
    trains its short group and cuts the long one; step 2 ends step 0's long group (written at steps 0, 1, 2:
    staleness 2, 1, 0) beside its own short one. Two slots; an admission prefills its fresh prompts in one forward
    and its resumed groups in another: step 1 admits step 0's long group with its own first prompt (2 forwards)
    and decodes once, then its second prompt (1 + 1); steps 2 and 3 admit two resumed groups, then two fresh."""
    from tidal.planner.partial import simulate_partial

    shape = StepShape(prompt_lens=(3, 3), lengths=((2,), (6,)), max_batch_prompts=2, admission="continuous")
    rates = Rates(gen=GenRates(forward_s=1.0), train=TrainRates(barrier_s=0.5))
    steps = simulate_partial([shape] * 4, rates, budget=2, schedule="sync")
    assert [s.groups for s in steps] == [1, 1, 2, 2]
    assert [s.step_s for s in steps] == [2.5, 5.5, 4.5, 4.5]  # the forwards, then the barrier
    assert [s.prediction.tokens for s in steps] == [5, 5, 5 + 9, 5 + 9]
    assert steps[2].staleness_mean == pytest.approx((2 * 2 + 2 * 1 + 2 * 0 + 2 * 0) / 8)
    assert steps[0].staleness_mean == 0


@pytest.mark.parametrize("schedule", ["sync", "periodic"])
def test_partial_rollouts_with_a_budget_above_every_length_are_the_plain_steps(schedule):
    from tidal.planner.partial import simulate_partial

    shape = StepShape(prompt_lens=(4, 7, 5, 6), lengths=((3, 9), (12, 2), (5, 5), (1, 7)), max_batch_prompts=2,
                      admission="continuous", replicas=2, dp=2)
    rates = Rates(gen=GenRates(forward_s=0.01, row_s=0.002, row_col_s=1e-4, prefill_token_s=1e-3, send_s=0.003),
                  train=TrainRates(group_s=0.05, token_s=0.002, barrier_s=0.1, push_s=0.02), reward_group_s=0.01,
                  handoff_s=0.004, concurrency=0.7)
    plain = simulate(shape, rates, schedule=schedule)
    for step in simulate_partial([shape] * 3, rates, budget=12, schedule=schedule):
        assert step.prediction == plain and step.groups == 4 and step.staleness_mean == 0


@pytest.mark.parametrize("forward_s, row_s, pays", [(0.02, 1e-5, True), (0.002, 2e-3, False)])
def test_partial_rollouts_pay_on_a_long_tail_where_a_forward_costs_the_same_for_few_rows(forward_s, row_s, pays):
    """One group in 8 runs 8x longer: periodic waits for it every step (4 rows decoding alone for 112 forwards);
    partial rollouts (budget = the short length) train each step's short groups and one long group ended over 8
    steps, whose tokens were written 7..0 steps before (staleness 3.5 on its 512 of the step's 960 response
    tokens). Where a forward costs about the same for 4 rows as for 32 (a device) that pays; where its cost
    follows its rows (this CPU), the resumed groups' prefills of their tokens so far cost more than the tail."""
    from tidal.planner.partial import simulate_partial

    rates = Rates(gen=GenRates(forward_s=forward_s, row_s=row_s),
                  train=TrainRates(group_s=0.02, token_s=2e-4, barrier_s=0.05, push_s=0.01), reward_group_s=0.001)
    tail = StepShape(prompt_lens=(16,) * 8, lengths=((16,) * 4,) * 7 + ((128,) * 4,), max_batch_prompts=8,
                     admission="continuous")
    plain = simulate(tail, rates, schedule="periodic")
    cut = simulate_partial([tail] * 24, rates, budget=16, schedule="periodic")[8:]  # the carry has filled
    assert all(s.groups == 8 and s.prediction.tokens == plain.tokens for s in cut)
    assert (plain.step_s > 1.5 * max(s.step_s for s in cut)) is pays
    assert (plain.step_s > max(s.step_s for s in cut)) is pays
    assert cut[0].staleness_mean == pytest.approx(3.5 * 512 / 960)
