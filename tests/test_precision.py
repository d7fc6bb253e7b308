"""trainer.precision=bf16 and fp16: fp32 master weights, bf16/fp16 compute and pushes; fp16's loss scale.

In-process (one rank) against the fp32 trainer on the same groups; the multi-rank cases (FSDP2's
mixed precision, sync == periodic bit for bit in bf16, a bf16 generator receiving the pushes) run
as a whole job at the end.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tidal.algorithms.grpo import GRPOConfig
from tidal.algorithms.registry import get_algorithm
from tidal.controller.schedules import Periodic
from tidal.executors.base import ExecutorEnv
from tidal.modeling.hf import load_model
from tidal.executors.trainer.accumulate import Mismatch
from tidal.executors.trainer.executor import Trainer, TrainerConfig
from tests.e2e import launch, metrics
from tests.fixtures import scored_groups
from tidal.common.spawn import spawn
from tests.test_trainer import _grads_seen, _step

torch.set_num_threads(1)


def _trainer(precision: str, **cfg) -> Trainer:
    cfg = {"lr": 1e-2, "micro_batch_size": 3, "grad_clip": 100.0, **cfg}
    trainer = Trainer(config=TrainerConfig(precision=precision, **cfg),
                      model_path=None, dtype=torch.float32, algorithm=get_algorithm("grpo"),
                      algo_config=GRPOConfig(beta=0.04), temperature=0.9, total_steps=4)
    trainer.init(ExecutorEnv(name="trainer", ranks=(0,), units=((0,),), rank=0, group=None,
                             device=torch.device("cpu"), seed=0, output_dir=Path("/nonexistent")))
    return trainer


@pytest.fixture(scope="module")
def groups():
    return scored_groups(n=4, G=4)


def test_bf16_keeps_fp32_master_weights_and_pushes_bf16(groups):
    trainer = _trainer("bf16")
    master, policy = trainer.models.master, trainer.models.policy
    assert master is not policy
    assert {p.dtype for p in master.parameters()} == {torch.float32}
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.models.reference.parameters()} == {torch.bfloat16}
    optimized = {id(p) for group in trainer.optim.opt.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in master.parameters()}  # AdamW steps (and keeps state for) fp32
    _, pushed = _step(trainer, groups)
    state = trainer.optim.opt.state[next(master.parameters())]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    init = dict(load_model(None, seed=0).named_parameters())
    for name, p in master.named_parameters():
        # the compute copy is the stepped master, cast; the push carries it
        assert torch.equal(dict(policy.named_parameters())[name], p.to(torch.bfloat16))
        assert pushed[name].dtype == torch.bfloat16 and torch.equal(pushed[name], p.to(torch.bfloat16))
    assert any(not torch.equal(p, init[n]) for n, p in master.named_parameters())


def test_bf16_compute_copy_holds_the_generators_bits():
    """The trainer's bf16 policy and reference hold exactly what the generator's bf16 load holds,
    buffers included: RoPE's inv_freq stays float32 on both sides (Module.to had rounded the
    trainer's copy to bf16, and the two forwards differed from the first layer on)."""
    models = _trainer("bf16").models
    generator = load_model(None, dtype=torch.bfloat16, seed=0)  # as the generator loads it
    for copy_ in (models.policy, models.reference):
        mine, theirs = dict(copy_.named_parameters()), dict(generator.named_parameters())
        assert mine.keys() == theirs.keys() and all(torch.equal(t, theirs[n]) for n, t in mine.items())
        buffers, expected = dict(copy_.named_buffers()), dict(generator.named_buffers())
        assert buffers and buffers.keys() == expected.keys()
        assert all(b.dtype == torch.float32 and torch.equal(b, expected[n]) for n, b in buffers.items())


def test_updates_below_bf16_resolution_accumulate_in_the_master(groups):
    """lr 1e-5: most updates are below half a bf16 ulp of their weight, so bf16 weights would not
    move; the fp32 master does, and the bf16 copy follows once the sum crosses an ulp."""
    trainer = _trainer("bf16", lr=1e-5)
    init = {n: p.detach().clone() for n, p in trainer.models.master.named_parameters()}
    _step(trainer, groups)
    moved = lost = 0
    for n, p in trainer.models.master.named_parameters():
        changed = p != init[n]
        moved += int(changed.sum())
        lost += int((changed & (p.to(torch.bfloat16) == init[n].to(torch.bfloat16))).sum())
    assert moved > 0 and lost > moved // 2, (moved, lost)  # pure bf16 weights would have kept none of these


def test_bf16_step_equals_fp32_step_within_bf16_tolerance(groups):
    fp32, bf16 = _trainer("fp32"), _trainer("bf16")
    g32, g16 = _grads_seen(fp32), _grads_seen(bf16)
    m32, _ = _step(fp32, groups)
    m16, _ = _step(bf16, groups)
    assert {g.dtype for g in g16.values()} == {torch.float32}  # the optimizer sees fp32 gradients
    num = sum(((g16[n] - g32[n]) ** 2).sum() for n in g32).sqrt()
    den = sum((g ** 2).sum() for g in g32.values()).sqrt()
    assert num / den < 0.05, (num / den).item()  # bf16 compute: ~3 significant digits per product
    assert abs(m16.loss - m32.loss) < 0.05 * max(1e-3, abs(m32.loss)) + 1e-3
    assert m16.logp_mismatch_max > m32.logp_mismatch_max  # the sampler ran fp32 here: bf16 shows


def test_bf16_arrival_order_does_not_change_a_bit(groups):
    _, a = _step(_trainer("bf16"), groups)
    _, b = _step(_trainer("bf16"), list(reversed(groups)), schedule=Periodic())
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_bf16_activation_checkpointing_and_head_chunks(groups):
    """Checkpointing replays the same bf16 forward: bit for bit. Head chunks change the bf16 head
    product's shape, so its rounding: within bf16 tolerance."""
    trainers = {"plain": _trainer("bf16"), "ac": _trainer("bf16", activation_checkpointing=True),
                "chunks": _trainer("bf16", logprob_chunk=2)}
    grads = {k: _grads_seen(t) for k, t in trainers.items()}
    for t in trainers.values():
        _step(t, groups)
    plain = grads["plain"]
    assert all(torch.equal(grads["ac"][n], g) for n, g in plain.items())
    err = max(((grads["chunks"][n] - g).abs().max() / g.abs().max()).item() for n, g in plain.items())
    assert err < 1e-2, err


def test_fp16_scales_the_loss_into_range_and_keeps_fp32_masters(groups):
    """fp16 compute, fp32 masters and AdamW state, fp16 pushes; the gradients the optimizer sees are the
    fp32 ones (the scale divided back out) within fp16 rounding."""
    fp32, fp16 = _trainer("fp32"), _trainer("fp16")
    master, policy = fp16.models.master, fp16.models.policy
    assert {p.dtype for p in master.parameters()} == {torch.float32}
    assert {p.dtype for p in policy.parameters()} == {torch.float16}
    g32, g16 = _grads_seen(fp32), _grads_seen(fp16)
    m32, _ = _step(fp32, groups)
    m16, pushed = _step(fp16, groups)
    assert m16.loss_scale == 2.0**8 and m16.skipped_steps == 0 and m32.loss_scale is None
    state = fp16.optim.opt.state[next(master.parameters())]
    assert state["exp_avg"].dtype == torch.float32 and int(state["step"]) == 1
    num = sum(((g16[n] - g32[n]) ** 2).sum() for n in g32).sqrt()
    den = sum((g ** 2).sum() for g in g32.values()).sqrt()
    assert num / den < 0.01, (num / den).item()  # fp16 keeps 3 more bits than bf16; unscaled, same size
    for name, p in master.named_parameters():
        assert pushed[name].dtype == torch.float16 and torch.equal(pushed[name], p.to(torch.float16))


def test_fp16_overflow_skips_the_step_and_halves_the_scale(groups, tmp_path):
    """A scale that overflows fp16's backward: the step changes no weight and no AdamW moment, the scale
    halves, and the next step (in range) trains; the scaler's state is part of the checkpoint."""
    trainer = _trainer("fp16", loss_scale={"init": 2.0**70, "window": 2})
    master = trainer.models.master
    init = {n: p.detach().clone() for n, p in master.named_parameters()}
    m, pushed = _step(trainer, groups)
    assert m.skipped_steps == 1 and m.loss_scale == 2.0**70 and not math.isfinite(m.grad_norm)
    assert trainer.optim.scaler.scale == 2.0**69 and not trainer.optim.opt.state
    assert all(torch.equal(p, init[n]) for n, p in master.named_parameters())
    assert all(torch.equal(pushed[n], init[n].to(torch.float16)) for n in init)
    trainer.optim.scaler.scale = 2.0**10
    m, _ = _step(trainer, groups)
    assert m.skipped_steps == 0 and math.isfinite(m.grad_norm) and m.loss_scale == 2.0**10
    assert any(not torch.equal(p, init[n]) for n, p in master.named_parameters())
    m, _ = _step(trainer, groups)  # the window's second good step: the scale doubles
    assert trainer.optim.scaler.state_dict() == {"scale": 2.0**11, "good_steps": 0, "skipped": 1}
    trainer.optim.save(tmp_path, group=None, leader=True)
    resumed = _trainer("fp16", loss_scale={"init": 2.0**70, "window": 2})
    resumed.optim.load(tmp_path, group=None)
    assert resumed.optim.scaler.state_dict() == trainer.optim.scaler.state_dict()


@pytest.mark.parametrize("algo, args, message", [
    ("grpo", ("trainer.backend=megatron",), "trainer.precision=fp16 with trainer.backend=megatron"),
    ("grpo", ("trainer.lora.rank=8",), "trainer.lora.rank=8 with trainer.precision=fp16"),
    ("grpo", ("model.dtype=bfloat16",), "trainer.precision=fp16 keeps float32 master weights"),
    ("ppo", ("critic.precision=fp16",), "critic.precision=fp16: the critic has no loss scale"),
])
def test_fp16_refuses_what_has_no_loss_scale(algo, args, message):
    from tidal.launch.cli import parser, resolve
    from tidal.recipes.grpo import build  # PPO's recipe builds with it too

    sets = [x for a in ("trainer.precision=fp16", *args) for x in ("--set", a)]
    with pytest.raises(ValueError) as err:
        build(resolve(parser().parse_args(["--algo", algo, *sets])))
    assert message in str(err.value)


def _mismatch_of(diffs: list[list[float]]) -> Mismatch:
    """Micro-batches of trainer - sampler differences, with a masked-out token beside each."""
    m = Mismatch()
    for d in diffs:
        sampled_NT = torch.tensor([[-2.0] * len(d) + [-9.0]])
        m.add(logp_NT=sampled_NT + torch.tensor([d + [5.0]]), sampled_NT=sampled_NT,
              mask_NT=torch.tensor([[True] * len(d) + [False]]))
    return m


def test_mismatch_figures_by_hand():
    d = [0.5, 0.0, 0.0, -0.25, 1.0]  # trainer - sampler, exact in binary
    got = _mismatch_of([d[:2], d[2:]]).summary()
    # |d| sorted: 0, 0, 0.25, 0.5, 1; p99 interpolates at 0.99 * 4 = 3.96 between 0.5 and 1
    k3 = sum(math.exp(x) - 1 - x for x in d) / 5  # KL(sampler || trainer), tokens drawn from the sampler
    assert got == pytest.approx({"logp_mismatch_max": 1.0, "logp_mismatch_mean": 0.35,
                                 "logp_mismatch_p99": 0.98, "logp_mismatch_kl": k3, "logp_mismatch_fresh_max": 1.0},
                                rel=1e-12)
    assert Mismatch().summary() == dict.fromkeys(got, 0.0)  # a step without tokens
    # tokens of an older policy (offpolicy, partial rollouts) count in every figure but the fresh one's
    m = Mismatch()
    m.add(logp_NT=torch.tensor([[0.5, -1.0, 0.25]]), sampled_NT=torch.zeros(1, 3), mask_NT=torch.ones(1, 3),
          fresh_NT=torch.tensor([[True, False, True]]))
    assert m.summary()["logp_mismatch_max"] == 1.0 and m.summary()["logp_mismatch_fresh_max"] == 0.5


def _gathered(diffs_per_rank: list[list[list[float]]]):
    import torch.distributed as dist

    dist.init_process_group("gloo")  # rank and world from spawn's environment
    try:
        return _mismatch_of(diffs_per_rank[dist.get_rank()]).all_gather(group=dist.group.WORLD).summary()
    finally:
        dist.destroy_process_group()


def test_mismatch_is_exact_over_dp_ranks_and_arrival_order():
    """The p99 (and every figure) of values spread over 2 dp ranks, of unequal counts, equals the
    one-rank figure of all of them, bit for bit, in any arrival order."""
    g = torch.Generator().manual_seed(0)
    d = (torch.randn(301, generator=g, dtype=torch.float64) * 0.1).tolist()
    whole = _mismatch_of([d]).summary()
    assert _mismatch_of([d[200:], d[:200]]).summary() == whole
    for got in spawn(_gathered, 2, [[d[:100], d[250:]], [d[100:250]]], timeout_s=120):
        assert got == whole


@pytest.fixture(scope="module")
def bf16_fsdp_runs(tmp_path_factory):
    """The 4-rank job (trainer dp=2, FSDP2 in bf16 mixed precision) under both schedules."""
    out = tmp_path_factory.mktemp("bf16")
    for schedule in ("sync", "periodic"):
        proc = launch(out / schedule, "--schedule", schedule, "--set", "trainer.precision=bf16",
                      "--set", "trainer.dp=2", "--set", "trainer.fsdp=true", nproc=4)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_bf16_fsdp_sync_equals_periodic_bit_for_bit(bf16_fsdp_runs):
    sync, periodic = bf16_fsdp_runs / "sync", bf16_fsdp_runs / "periodic"
    assert [r["trainer/rollout_digest"] for r in metrics(sync)] == [r["trainer/rollout_digest"] for r in metrics(periodic)]
    a, b = load_file(sync / "final/model.safetensors"), load_file(periodic / "final/model.safetensors")
    assert all(t.dtype == torch.float32 and torch.equal(t, b[n]) for n, t in a.items())  # fp32 master saved
    rows = metrics(periodic)
    # the trainer (bf16 FSDP gathers) recomputes what the bf16 generator sampled, within bf16 rounding:
    # with the head and attention in float32 on both sides and the same RoPE buffers, most tokens of
    # this small model agree to the bit (a step may have none that differ); a stale float32 head on
    # the generator after a push measured a mean of 4.6e-3 here
    figures = ("trainer/logp_mismatch_mean", "trainer/logp_mismatch_p99", "trainer/logp_mismatch_max",
               "trainer/logp_mismatch_kl")
    assert all(0 <= r["trainer/logp_mismatch_mean"] <= r["trainer/logp_mismatch_p99"] <= r["trainer/logp_mismatch_max"] < 0.1
               and r["trainer/logp_mismatch_mean"] < 1e-3 and r["trainer/logp_mismatch_kl"] >= 0 for r in rows), \
        [[r[k] for k in figures] for r in rows]
    # gathered over both dp ranks and sorted: the same figures whichever order the groups arrived in
    assert [[r[k] for k in figures] for r in metrics(sync)] == [[r[k] for k in figures] for r in rows]
