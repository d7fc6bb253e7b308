"""Placement: executors without a device, and placement=colocated (every executor on the same ranks,
taking turns on each device) giving the same bits as the split placement."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from tidal.channels import p2p
from tidal.channels.push import WeightPush
from tidal.channels.push_plan import GeneratorLayout, TrainerLayout, build_plan
from tidal.controller.world import device_index, rank_plan
from tidal.launch.cli import parser, resolve
from tidal.recipes.grpo import build
from tests.e2e import launch, metrics, weights
from tidal.common.spawn import spawn

# a CPU kernel's float sums follow its thread count: every layout runs 1 thread per rank
SAME_THREADS = {"TIDAL_THREADS": "1"}
SYNC = ("--schedule", "sync")
TWO = ("--set", "generator.replicas=2", "--set", "trainer.dp=2")


def _graph(*args: str):
    return build(resolve(parser().parse_args(["--algo", "grpo", *args])))


# ---- where each rank computes ---------------------------------------------------------------------
def test_reward_ranks_hold_no_device_and_device_ranks_number_per_node():
    """8 generator + trainer ranks and one reward process (--nproc-per-node 9): the reward takes no
    accelerator, so the 8 device ranks take indices 0-7; its group is gloo only."""
    graph = _graph("--set", "generator.replicas=4", "--set", "trainer.dp=4")
    plan = rank_plan(graph)
    assert [(r, runs, index, backend) for r, runs, index, backend in plan] == [
        (0, "generator", 0, "device"), (1, "generator", 1, "device"), (2, "generator", 2, "device"),
        (3, "generator", 3, "device"), (4, "reward", None, "gloo"), (5, "trainer", 4, "device"),
        (6, "trainer", 5, "device"), (7, "trainer", 6, "device"), (8, "trainer", 7, "device")]
    # two nodes of 5 ranks: each node numbers its own device ranks from 0
    assert [device_index(graph, rank=r, local_rank=r % 5) for r in range(9)] == [0, 1, 2, 3, None, 0, 1, 2, 3]


def test_colocated_runs_every_executor_on_every_rank_with_a_device():
    graph = _graph("--set", "placement=colocated", "--set", "eval.every=2", *TWO)
    assert [(r, runs, index) for r, runs, index, _ in rank_plan(graph)] == [
        (0, "generator, eval_sampler, reward, eval, trainer", 0),
        (1, "generator, eval_sampler, reward, eval, trainer", 1)]
    assert graph.executor("reward").units == 2  # one reward replica per rank


# ---- a rank's messages to itself ---------------------------------------------------------------------
def _self_messages():
    dist.init_process_group("gloo")
    a = torch.arange(6, dtype=torch.float32)
    p2p.isend(a, 0, tag=3)
    a += 100  # a send that is not `owned` was copied when posted
    p2p.isend(torch.tensor([7, 8], dtype=torch.int64), 0, tag=3, owned=True)
    first, second = torch.zeros(2, 3), torch.zeros(16, dtype=torch.uint8)
    w1, w2 = p2p.irecv(first, 0, tag=3), p2p.irecv(second, 0, tag=3)  # posted before they are taken
    assert not w1.is_completed()
    w1.wait(), w2.wait()
    dist.destroy_process_group()
    return first, second.view(torch.int64)


def test_messages_to_oneself_arrive_in_order_as_bytes():
    (first, second), = spawn(_self_messages, 1, timeout_s=60)
    assert torch.equal(first, torch.arange(6, dtype=torch.float32).view(2, 3))
    assert second.tolist() == [7, 8]


# ---- the push between layouts that share ranks ----------------------------------------------------------
ZERO_COPY = 4096  # pieces this big go without a bucket: here most of the tiny model's weights
SHARED = {  # trainer (ranks, tp, fsdp) -> generator (ranks, tp), on 2 ranks
    "dp2 > x2": ((0, 1), 1, False, (0, 1), 1),
    "tp2 > x2": ((0, 1), 2, False, (0, 1), 1),
    "fsdp2 > tp2": ((0, 1), 1, True, (0, 1), 2),
    "tp1 on 0 > x2 relayed": ((0,), 1, False, (0, 1), 1),
}


def _push_shared():
    from tidal.modeling.parallel import build_mesh, param_specs, parallelize
    from tests.test_reshard import _train_step, local, qwen3

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), {}
    for name, (t_ranks, tp_t, fsdp, g_ranks, tp_g) in SHARED.items():
        t_mesh = build_mesh(ranks=t_ranks, tp=tp_t, members_only=False)
        g_mesh = build_mesh(ranks=g_ranks, tp=tp_g, members_only=False) if tp_g > 1 else None
        specs = param_specs(qwen3(meta=True))
        plan = build_plan(specs=specs, trainer=TrainerLayout(ranks=t_ranks, tp=tp_t, fsdp=fsdp),
                          generator=GeneratorLayout(ranks=g_ranks, tp=tp_g), bucket_bytes=8192,
                          zero_copy_min_bytes=ZERO_COPY)
        sender, receiver = WeightPush(plan, rank=rank, side="send"), WeightPush(plan, rank=rank, side="receive")
        engine = qwen3(seed=1)
        if tp_g > 1:
            parallelize(engine, mesh=g_mesh, tp=True, fsdp=False)
        works, full, sent = [], None, {}
        if rank in t_ranks:  # as the trainer's barrier posts it (tidal/channels/weights.py: co-located, sync)
            model = parallelize(qwen3(seed=0), mesh=t_mesh, tp=tp_t > 1, fsdp=fsdp)
            _train_step(model, seed=0)
            sent = {n: local(p.detach()) for n, p in model.named_parameters()}
            works = [p2p.isend(buf, dst, owned=True) for dst, buf in sender.pack(sent, copy=False)]
            full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                    for n, p in model.named_parameters()}
        shards = {n: local(p.detach()) for n, p in engine.named_parameters()}
        receiver.run(shards)  # as the next step's start
        for w in works:
            w.wait()
        local_bytes = sum(p.nbytes for p in plan.pieces if p.src == p.dst)
        # the entries that are now the trainer's own memory: the generator holds the model once
        taken = {n for n, t in shards.items() if n in sent and t.data_ptr() == sent[n].data_ptr()}
        out[name] = (full, {n: t.clone() for n, t in shards.items()}, local_bytes,
                     sum(p.nbytes for p in plan.pieces), taken)
        dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def pushed_shared():
    return spawn(_push_shared, 2, timeout_s=240)


@pytest.mark.parametrize("layout", list(SHARED))
def test_push_between_shared_ranks_lands_bit_for_bit(pushed_shared, layout):
    """A trainer and a generator on the same ranks: every generator shard equals the trainer's
    weights; where a rank holds the piece it needs (dp replicas onto replicas), nothing crosses ranks."""
    from tidal.modeling.parallel import param_specs
    from tests.test_reshard import _sl, qwen3

    t_ranks, _, _, g_ranks, tp_g = SHARED[layout]
    full = pushed_shared[t_ranks[0]][layout][0]
    specs = param_specs(qwen3(meta=True))
    g = GeneratorLayout(ranks=g_ranks, tp=tp_g)
    for rank in g_ranks:
        _, got, local_bytes, total, taken = pushed_shared[rank][layout]
        t = g_ranks.index(rank) % tp_g
        for n, s in specs.items():
            assert torch.equal(got[n], full[n][_sl(g.box(s, t=t))]), (layout, rank, n)
        # a whole tensor the rank's own trainer holds in the same layout and dtype is handed over, not
        # copied (the smaller ones travel in buckets); a part of one (tp 2 into tp 1) is copied
        big = {n for n, s in specs.items() if math.prod(s.shape) * 4 >= ZERO_COPY}
        expected = big if layout == "dp2 > x2" or (layout.endswith("relayed") and rank == 0) else set()
        if layout == "fsdp2 > tp2":  # FSDP's row halves meet tp's where their shapes agree
            assert taken <= big, (layout, rank, sorted(taken - big)[:3])
        else:
            assert taken == expected, (layout, rank, sorted(taken ^ expected)[:3])
    if layout == "dp2 > x2":
        assert local_bytes == total  # each replica is fed by the trainer rank beside it


# ---- whole jobs: co-located against split ---------------------------------------------------------------
RUNS = {  # name -> (args, nproc)
    "split": ((*SYNC,), 3),
    "colocated": (("--set", "placement=colocated", "--set", "checkpoint_every=1", "--set", "checkpoint_keep=0"), 1),
    "split x2": ((*SYNC, *TWO), 5),
    "colocated x2": (("--set", "placement=colocated", *TWO), 2),
    "ppo split": ((*SYNC,), 4),
    "ppo colocated": (("--set", "placement=colocated"), 1),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    for name, (args, nproc) in RUNS.items():
        proc = launch(root / name, *args, nproc=nproc, steps=4, timeout=400, env=SAME_THREADS,
                      algo="ppo" if name.startswith("ppo") else "grpo")
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    return root


@pytest.mark.parametrize("split, colocated", [("split", "colocated"), ("split x2", "colocated x2"),
                                              ("ppo split", "ppo colocated")])
def test_colocated_gives_the_split_placements_bits(runs, split, colocated):
    """The same sync job on one process (or 2 ranks of trainer dp=2 / generator replicas=2) and split
    over 3 (5; PPO: 4 with its critic): the same rollouts every step and the same final weights."""
    a, b = metrics(runs / split), metrics(runs / colocated)
    assert [r["trainer/rollout_digest"] for r in a] == [r["trainer/rollout_digest"] for r in b]
    assert len({r["trainer/rollout_digest"] for r in a}) == 4  # the policy changed: each step sampled anew
    wa, wb = weights(runs / split / "final"), weights(runs / colocated / "final")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_colocated_times_its_memory_moves(runs):
    """Each step: the engine releases after generating and wakes before the next step (the first
    step's engine starts awake); the optimizer state comes back to train and leaves after the push."""
    events = [json.loads(line) for line in (runs / "colocated" / "timeline" / "rank000.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events if e["step"] >= 0 and e["kind"] in ("generate", "offload", "onload", "train", "push")]
    assert kinds.count("offload") == 2 * 4 and kinds.count("onload") == 2 * 4 - 1
    first = kinds[:kinds.index("push") + 2]
    assert first == ["generate", "offload", "onload", *["train"] * 4, "push", "offload"]


def test_the_planner_reads_the_swap_from_a_colocated_run(runs):
    from tidal.planner.calibrate import swap_seconds

    steps = metrics(runs / "colocated")
    assert 0 < swap_seconds(runs / "colocated") < min(r["step_s"] for r in steps[1:])
    with pytest.raises(ValueError, match="no offload/onload spans"):
        swap_seconds(runs / "split")


def test_colocated_resume_equals_the_whole_run(runs, tmp_path):
    ckpt = runs / "colocated" / "checkpoints" / "step_000001"
    proc = launch(tmp_path, "--set", "placement=colocated", "--resume", str(ckpt), nproc=1, steps=4, timeout=300,
                  env=SAME_THREADS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole, resumed = weights(runs / "colocated" / "final"), weights(tmp_path / "final")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert [r["trainer/rollout_digest"] for r in metrics(tmp_path)][-2:] == [r["trainer/rollout_digest"] for r in metrics(runs / "colocated")][-2:]


# ---- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (("--schedule", "periodic"), "placement=colocated with schedule periodic"),
    (("--schedule", "offpolicy"), "placement=colocated with schedule offpolicy"),
    (("--set", "trainer.dp=2"), "trainer.dp x trainer.tp = 2 x 1 must equal generator.replicas x generator.tp = 1 x 1"),
    (("--set", "reward.model.seed=1"), "placement=colocated with reward.model is not supported"),
    (("--set", "generator.engine=vllm"), "cannot give its memory back"),
])
def test_bad_colocated_settings_are_refused_before_any_rank_starts(args, message):
    base = ["--algo", "grpo", "--set", "placement=colocated"]
    with pytest.raises(ValueError) as err:
        build(resolve(parser().parse_args(base + list(args))))
    assert message in str(err.value)


def test_colocated_picks_the_sync_schedule_when_none_is_given():
    cfg = resolve(parser().parse_args(["--algo", "grpo", "--set", "placement=colocated"]))
    assert cfg.schedule.kind == "sync" and cfg.sources["schedule.kind"] == "auto"  # its only schedule
    # a vLLM engine shares the device with the trainer: a smaller share by default, the user's if given
    vllm = ["--algo", "grpo", "--set", "placement=colocated", "--set", "generator.engine=vllm"]
    cfg = resolve(parser().parse_args(vllm))
    assert cfg.generator.vllm.gpu_memory_utilization == 0.4
    assert cfg.sources["generator.vllm.gpu_memory_utilization"] == "placement=colocated"
    cfg = resolve(parser().parse_args([*vllm, "--set", "generator.vllm.gpu_memory_utilization=0.6"]))
    assert cfg.generator.vllm.gpu_memory_utilization == 0.6


def test_a_world_size_neither_placement_fits_names_both(tmp_path):
    proc = launch(tmp_path, nproc=2, steps=1, timeout=120)
    assert proc.returncode != 0
    assert ("world size is 2, but placement=split needs --nproc-per-node 3 (generator 1 + reward 1 + trainer 1); "
            "placement=colocated --schedule sync needs 1") in proc.stderr
