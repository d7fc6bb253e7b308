"""The trainer's step equals a plain single-process PyTorch GRPO step; order and splits don't matter."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tidal.algorithms.grpo import GRPOConfig
from tidal.algorithms.registry import get_algorithm
from tidal.controller.schedules import Periodic, Sync
from tidal.controller.timeline import Timeline
from tidal.executors.base import ExecutorEnv, Endpoints, StepContext
from tidal.modeling.hf import load_model
from tidal.executors.trainer.executor import Trainer, TrainerConfig
from tidal.executors.trainer.stats import TrainerMetrics
from tests.fixtures import scored_groups

torch.set_num_threads(1)


class _Pushed:
    """Receives the trainer's weight push in-process (the multi-rank push is tested in test_weights)."""
    bytes_per_push = 0  # what a WEIGHTS port reports (tidal/controller/world.py Outlet)

    def __init__(self):
        self.named = None

    def push(self, shards, specs):
        assert shards.keys() == specs.keys()
        self.named = {n: t.detach().clone() for n, t in shards.items()}

    def flush(self):
        pass


def _trainer(*, beta=0.04, micro_batch_size=8, entropy_coef=0.0, shared_prompt="auto") -> Trainer:
    trainer = Trainer(config=TrainerConfig(lr=1e-2, micro_batch_size=micro_batch_size, grad_clip=0.5,
                                           shared_prompt=shared_prompt),
                      model_path=None, dtype=torch.float32, algorithm=get_algorithm("grpo"),
                      algo_config=GRPOConfig(beta=beta, clip_low=0.2, clip_high=0.28, entropy_coef=entropy_coef),
                      temperature=0.9, total_steps=4)
    trainer.init(ExecutorEnv(name="trainer", ranks=(0,), units=((0,),), rank=0, group=None,
                             device=torch.device("cpu"), seed=0, output_dir=Path("/nonexistent")))
    return trainer


def _grads_seen(trainer: Trainer) -> dict:
    """The gradients the optimizer receives, captured by a step pre-hook."""
    seen = {}
    names = {id(p): n for n, p in trainer.models.master.named_parameters()}  # what the optimizer steps
    trainer.optim.opt.register_step_pre_hook(lambda opt, *_: seen.update(
        {names[id(p)]: p.grad.clone() for group in opt.param_groups for p in group["params"]}))
    return seen


def _step(trainer: Trainer, groups, *, schedule=Periodic()) -> tuple[TrainerMetrics, dict]:
    """One step as the controller runs it: the streamed phase, then the barrier."""
    pushed = _Pushed()
    ctx = StepContext(step=0, inbound=Endpoints({"scored": schedule(iter(groups))}), outbound=Endpoints({"weights": pushed}),
                      timeline=Timeline(executor="trainer", rank=0))
    metrics = trainer.barrier(ctx, trainer.step(ctx))
    return metrics, pushed.named


def _reference_step(groups, *, beta: float, temperature: float, entropy_coef: float = 0.0) -> dict:
    """GRPO written out plainly: one sequence at a time, the batch mean taken directly."""
    policy, ref = load_model(None, seed=0), load_model(None, seed=0)
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    terms = []
    for g in groups:
        r = g.rewards.double()
        adv = ((r - r.mean()) / (r.std(unbiased=False) + 1e-6)).float()
        for i, resp in enumerate(g.responses):
            ids = torch.cat([g.prompt_ids, resp])[None]
            P = g.prompt_ids.numel()

            def logp(model):
                logits = model(input_ids=ids).logits[0, P - 1: -1].float() / temperature
                return torch.log_softmax(logits, -1)

            all_lp = logp(policy)
            lp = all_lp.gather(-1, resp[:, None])[:, 0]
            entropy = -(all_lp.exp() * all_lp).sum(-1)
            with torch.no_grad():
                lr_ = logp(ref).gather(-1, resp[:, None])[:, 0]
            ratio = torch.exp(lp - lp.detach())
            pg = -torch.minimum(ratio * adv[i], ratio.clamp(1 - 0.2, 1 + 0.28) * adv[i])
            k3 = torch.exp(lr_ - lp) - (lr_ - lp) - 1
            terms.append((pg + beta * k3 - entropy_coef * entropy).mean())
    loss = torch.stack(terms).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 0.5)
    return {n: p.grad.clone() for n, p in policy.named_parameters()}


@pytest.fixture(scope="module")
def groups():
    return scored_groups(n=4, G=4)


def test_step_equals_plain_reference(groups):
    """The gradient the optimizer receives (normalised at the barrier, clipped) equals plain GRPO.

    Compared before the optimizer: Adam's first update is ~lr*sign(g), which turns float32 noise in
    near-zero gradient entries (padded micro-batches vs single sequences) into lr-sized differences.
    """
    assert len({tuple(g.rewards.tolist()) for g in groups}) > 1  # the batch carries a learning signal
    trainer = _trainer(beta=0.04, micro_batch_size=3)
    seen = _grads_seen(trainer)
    metrics, pushed = _step(trainer, groups)
    expected = _reference_step(groups, beta=0.04, temperature=0.9)
    assert seen.keys() == expected.keys()
    worst = max((seen[n] - g).abs().max().item() for n, g in expected.items())
    assert worst < 1e-6, worst
    assert max(g.abs().max().item() for g in expected.values()) > 1e-3  # a real gradient, not ~0
    # the push carries exactly the stepped policy
    assert pushed.keys() == {n for n, _ in trainer.models.policy.named_parameters()}
    assert all(torch.equal(pushed[n], p) for n, p in trainer.models.policy.named_parameters())
    init = dict(load_model(None, seed=0).named_parameters())
    assert any(not torch.equal(pushed[n], init[n]) for n in pushed)
    assert metrics.groups == 4 and metrics.logp_mismatch_max < 1e-4


@pytest.mark.parametrize("shared_prompt", ["padded", "on"])
def test_an_entropy_bonus_equals_the_plain_reference(groups, shared_prompt):
    """algorithm.entropy_coef: each token's loss less coef * its entropy, the gradient through the chunked head."""
    trainer = _trainer(beta=0.04, micro_batch_size=3, entropy_coef=1.0, shared_prompt=shared_prompt)
    seen = _grads_seen(trainer)
    _step(trainer, groups)
    expected = _reference_step(groups, beta=0.04, temperature=0.9, entropy_coef=1.0)
    without = _reference_step(groups, beta=0.04, temperature=0.9)
    worst = max((seen[n] - g).abs().max().item() for n, g in expected.items())
    assert worst < 1e-6, worst
    assert max((without[n] - g).abs().max().item() for n, g in expected.items()) > 100 * 1e-6  # the bonus moved it


def test_arrival_order_and_micro_batches_do_not_change_a_bit(groups):
    _, a = _step(_trainer(micro_batch_size=4), groups)
    _, b = _step(_trainer(micro_batch_size=4), list(reversed(groups)))
    assert all(torch.equal(a[n], b[n]) for n in a)  # rule 3: order-independent accumulation
    t4, t1 = _trainer(micro_batch_size=4), _trainer(micro_batch_size=1)
    g4, g1 = _grads_seen(t4), _grads_seen(t1)
    _step(t4, groups), _step(t1, groups)
    assert max((g4[n] - g1[n]).abs().max().item() for n in g4) < 1e-6  # normalisation survives splits


def test_sync_consumption_equals_streaming(groups):
    shuffled = [groups[i] for i in (2, 0, 3, 1)]  # arrival order; sync hands them over in index order
    _, a = _step(_trainer(), shuffled, schedule=Periodic())
    _, b = _step(_trainer(), shuffled, schedule=Sync())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], p) for n, p in load_model(None, seed=0).named_parameters())  # it trained


def _trainer_for(algorithm, algo_config, *, micro_batch_size=3) -> Trainer:
    trainer = Trainer(config=TrainerConfig(lr=1e-2, micro_batch_size=micro_batch_size, grad_clip=100.0),
                      model_path=None, dtype=torch.float32, algorithm=algorithm, algo_config=algo_config,
                      temperature=0.9, total_steps=4)
    trainer.init(ExecutorEnv(name="trainer", ranks=(0,), units=((0,),), rank=0, group=None,
                             device=torch.device("cpu"), seed=0, output_dir=Path("/nonexistent")))
    return trainer


@pytest.mark.parametrize("options", [{}, {"baseline": True}, {"beta": 0.05, "kl_in": "loss"}])
def test_batch_scope_advantages_streamed_equal_known_statistics(groups, options):
    """REINFORCE++ trained group by group (batch mean/std unknown until the barrier) gets the same
    gradient as the same loss with the batch statistics known in advance."""
    from dataclasses import replace

    from tidal.algorithms.reinforce_pp import ReinforcePPConfig

    algo, cfg = get_algorithm("reinforce_pp"), ReinforcePPConfig(**options)
    scores = torch.cat([algo.advantages(g.rewards, cfg) for g in groups]).double()
    mu, sigma = scores.mean().item(), scores.std(unbiased=False).item()
    known = replace(algo, advantage_scope="group",
                    advantages=lambda r, c: (algo.advantages(r, c) - mu) / (sigma + c.eps))
    streamed, reference = _trainer_for(algo, cfg), _trainer_for(known, cfg)
    g_s, g_r = _grads_seen(streamed), _grads_seen(reference)
    m_s, _ = _step(streamed, list(reversed(groups)))
    m_r, _ = _step(reference, groups)
    assert max((g_s[n] - g_r[n]).abs().max().item() for n in g_r) < 1e-6
    assert max(g.abs().max().item() for g in g_r.values()) > 1e-4
    assert m_s.loss == pytest.approx(m_r.loss, abs=1e-6)


def test_kl_in_reward_penalises_rewards_before_advantages():
    """beta with kl_in="reward": the gradient equals GRPO on rewards already penalised by the KL of the
    sampling log-probs to the reference. The samples come from another model (seed 1) than the
    reference (the trainer's initial weights, seed 0), so that KL is far from 0."""
    from dataclasses import replace

    groups = scored_groups(n=4, G=4, seed=1)
    from tidal.algorithms.kl import kl_penalised_rewards

    cfg = GRPOConfig(beta=0.5, kl_in="reward")
    algo = get_algorithm("grpo")
    ref = load_model(None, seed=0)
    penalised = []
    for g in groups:  # the reference's log-probs of the sampled tokens, one sequence at a time
        P, r_G = g.prompt_ids.numel(), g.rewards.clone().double()
        for i, resp in enumerate(g.responses):
            with torch.no_grad():
                logits = ref(input_ids=torch.cat([g.prompt_ids, resp])[None]).logits[0, P - 1:-1].float() / 0.9
            ref_T = torch.log_softmax(logits, -1).gather(-1, resp[:, None])[:, 0]
            r_G[i] = kl_penalised_rewards(rewards_N=r_G[i:i + 1], logp_NT=g.logprobs[i][None], ref_logp_NT=ref_T[None],
                                          mask_NT=torch.ones(1, resp.numel(), dtype=torch.bool), cfg=cfg)[0]
        penalised.append(replace(g, rewards=r_G.float()))
    assert any(not torch.equal(a.rewards, b.rewards) for a, b in zip(groups, penalised))
    t_kl, t_plain = _trainer_for(algo, cfg), _trainer_for(algo, GRPOConfig(beta=0.0))
    g_kl, g_plain = _grads_seen(t_kl), _grads_seen(t_plain)
    _step(t_kl, groups), _step(t_plain, penalised)
    assert max((g_kl[n] - g_plain[n]).abs().max().item() for n in g_kl) < 1e-5


def test_several_optimizer_steps_use_the_old_policy_snapshot(groups):
    """mini_batches=2, epochs=2: four optimizer steps on one batch. Each step's gradient equals plain
    GRPO on that mini-batch's groups at the weights of that moment, with the ratio taken against the
    generation weights (the snapshot), so clipping is active after the first step."""
    trainer = Trainer(config=TrainerConfig(lr=5e-2, micro_batch_size=3, grad_clip=100.0, mini_batches=2, epochs=2),
                      model_path=None, dtype=torch.float32, algorithm=get_algorithm("grpo"),
                      algo_config=GRPOConfig(clip_low=0.1, clip_high=0.1), temperature=0.9, total_steps=4)
    trainer.init(ExecutorEnv(name="trainer", ranks=(0,), units=((0,),), rank=0, group=None,
                             device=torch.device("cpu"), seed=0, output_dir=Path("/nonexistent")))
    names = {id(p): n for n, p in trainer.models.master.named_parameters()}  # what the optimizer steps
    steps = []  # (weights before the step, gradient) per optimizer step
    trainer.optim.opt.register_step_pre_hook(lambda opt, *_: steps.append((
        {names[id(p)]: p.detach().clone() for g in opt.param_groups for p in g["params"]},
        {names[id(p)]: p.grad.clone() for g in opt.param_groups for p in g["params"]})))
    metrics, _ = _step(trainer, list(reversed(groups)))
    assert len(steps) == 4 and metrics.optimizer_steps == 4
    old = load_model(None, seed=0)
    clipped_somewhere = False
    for k, (weights, grads) in enumerate(steps):
        mb_groups = [g for g in groups if g.index % 2 == k % 2]  # mini-batch of step k: index % 2
        policy = load_model(None, seed=0)
        policy.load_state_dict(weights, strict=False)
        terms = []
        for g in mb_groups:
            r = g.rewards.double()
            adv = ((r - r.mean()) / (r.std(unbiased=False) + 1e-6)).float()
            for i, resp in enumerate(g.responses):
                ids, P = torch.cat([g.prompt_ids, resp])[None], g.prompt_ids.numel()

                def logp(model):
                    logits = model(input_ids=ids).logits[0, P - 1: -1].float() / 0.9
                    return torch.log_softmax(logits, -1).gather(-1, resp[:, None])[:, 0]

                with torch.no_grad():
                    old_lp = logp(old)
                ratio = torch.exp(logp(policy) - old_lp)
                clipped_somewhere |= bool(((ratio - 1).abs() > 0.1).any())
                terms.append(-torch.minimum(ratio * adv[i], ratio.clamp(0.9, 1.1) * adv[i]).mean())
        torch.stack(terms).mean().backward()
        worst = max((grads[n] - p.grad).abs().max().item() for n, p in policy.named_parameters())
        assert worst < 1e-6, (k, worst)
    assert clipped_somewhere  # later steps really ran off-policy enough for clipping to matter


def _loss_sums_of_two_ranks():
    """Rank 0 trained two micro-batches with a statistic of a new name; rank 1 trained none (no figures)."""
    import torch.distributed as dist

    from tidal.algorithms.base import LossOutput
    from tidal.algorithms.figures import Largest, Mean
    from tidal.executors.trainer.accumulate import LossSums, Pass

    dist.init_process_group("gloo")
    sums = LossSums()
    if dist.get_rank() == 0:
        for k in (1.0, 2.0):
            sums.add_loss(Pass.SCORE, LossOutput(loss_sum=torch.tensor(k), denom=2.0,
                                                 stats={"kl": Mean(k, 2.0), "peak": Largest(k), "my_new": Mean(3 * k, k)}))
    out = sums.all_reduce(group=dist.group.WORLD)
    dist.destroy_process_group()
    return out.figures, out.denom


def test_a_loss_statistic_is_one_line_in_the_loss_and_reaches_the_metrics_by_its_name():
    """A loss's statistics are summed by name over micro-batches and dp ranks (a rank that trained nothing
    has none: the names are agreed first) and posted as trainer/<name>; a step that trained nothing posts none."""
    from tidal.algorithms.figures import Largest, Mean
    from tidal.common.spawn import spawn
    from tidal.executors.trainer.accumulate import GroupRecord, LossSums
    from tidal.executors.trainer.barrier import OptimizerStep

    for figures, denom in spawn(_loss_sums_of_two_ranks, 2, timeout_s=120):
        assert figures == {"kl": Mean(3.0, 4.0), "my_new": Mean(9.0, 3.0), "peak": Largest(2.0)} and denom == 4.0
    step = OptimizerStep(LossSums(denom=4.0, figures=figures), loss=1.0, grad_norm=0.5, lr=1e-3)
    record = GroupRecord(reward_sum=1.0, reward_sq_sum=1.0, samples=2.0, len_sum=4.0, groups=1.0, tokens=6.0)
    timing = dict(train_s=1.0, push_s=0.1, push_bytes=0, first_train_t=None, push_end_t=2.0)
    row = TrainerMetrics.of(record, [step], {0: "d"}, errors={}, staleness=(0.0, 0), **timing).as_metrics()
    assert (row["kl"], row["my_new"], row["peak"], row["loss"]) == (0.75, 3.0, 2.0, 0.25)
    empty = TrainerMetrics.of(GroupRecord(), [], {}, errors={}, staleness=(0.0, 0), **timing).as_metrics()
    assert "kl" not in empty and empty["groups"] == 0 and empty["loss"] != empty["loss"]  # NaN
