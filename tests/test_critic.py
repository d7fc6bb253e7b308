"""The critic and the trainer's per-token advantages against plain single-process PyTorch PPO: the
values of packed rows, the advantages sent, the value loss's gradient (first pass and a clipped later
epoch), and the trainer's whitened PPO-clip gradient; arrival order changes no bit."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tidal.algorithms.ppo import PPOConfig
from tidal.algorithms.registry import get_algorithm
from tidal.channels.payloads import AdvantagedGroup
from tidal.controller.schedules import Periodic, Sync
from tidal.controller.timeline import Timeline
from tidal.executors.base import ExecutorEnv, Endpoints, StepContext
from tidal.executors.critic.config import CriticConfig
from tidal.executors.critic.executor import Critic
from tidal.executors.critic.model import load_value_model
from tidal.modeling.hf import load_model
from tidal.executors.trainer.executor import Trainer, TrainerConfig
from tidal.executors.learner.models import micro_batches
from tests.fixtures import scored_groups
from tests.tolerances import LOGP_OF_FLOAT64

torch.set_num_threads(1)
T = 0.9  # the fixtures' sampling temperature
ALGO = PPOConfig(beta=0.05, gamma=0.9, lam=0.8, vf_clip=0.01)


class _Sent:
    """Collects what an executor sends on one output port, in-process."""
    bytes_per_push = 0  # what a WEIGHTS port reports (tidal/controller/world.py Outlet)

    def __init__(self):
        self.items = []

    def send(self, item):
        self.items.append(item)

    def push(self, shards, specs):  # the trainer's weights port
        pass

    def flush(self):
        pass


def _env(name: str) -> ExecutorEnv:
    return ExecutorEnv(name=name, ranks=(0,), units=((0,),), rank=0, group=None, device=torch.device("cpu"), seed=0,
                       output_dir=Path("/nonexistent"))


def _critic(**cfg) -> Critic:
    critic = Critic(config=CriticConfig(lr=1e-2, grad_clip=0.5, **cfg), model_path=None, dtype=torch.float32,
                    algo_config=ALGO, temperature=T, total_steps=4)
    critic.init(_env("critic"))
    return critic


def _recorded(optim) -> list[tuple[dict, dict]]:
    """(gradients, weights before the step) of every optimizer step, by a step pre-hook."""
    seen, names = [], {id(p): n for n, p in optim.model.named_parameters()}
    optim.opt.register_step_pre_hook(lambda opt, *_: seen.append((
        {names[id(p)]: p.grad.clone() for g in opt.param_groups for p in g["params"]},
        {names[id(p)]: p.detach().clone() for g in opt.param_groups for p in g["params"]})))
    return seen


def _critic_step(critic: Critic, groups, *, schedule=Periodic()):
    out = _Sent()
    ctx = StepContext(step=0, inbound=Endpoints({"scored": schedule(iter(groups))}), outbound=Endpoints({"advantaged": out}),
                      timeline=Timeline(executor="critic", rank=0))
    metrics = critic.barrier(ctx, critic.step(ctx))
    return metrics, sorted(out.items, key=lambda g: g.index)


@pytest.fixture(scope="module")
def groups():
    return scored_groups(n=4, G=4, max_new_tokens=6)


# ---- the plain reference: one sequence at a time, loops over tokens --------------------------------

def _token_values(model, group, i) -> torch.Tensor:
    P, R = group.prompt_ids.numel(), group.responses[i].numel()
    ids = torch.cat([group.prompt_ids, group.responses[i]])[None]
    return model(input_ids=ids).logits[0, P - 1: P - 1 + R, 0]


def _token_logprobs(model, group, i) -> torch.Tensor:
    P, resp = group.prompt_ids.numel(), group.responses[i]
    logits = model(input_ids=torch.cat([group.prompt_ids, resp])[None]).logits[0, P - 1: -1].float() / T
    return torch.log_softmax(logits, -1).gather(-1, resp[:, None])[:, 0]


def _gae_by_loop(r: list[float], v: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    adv, last = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        delta = r[t] + gamma * (v[t + 1] if t + 1 < len(r) else 0.0) - v[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, [a + x for a, x in zip(adv, v)]


def _plain_targets(groups):
    """Per sample: (values at the start, advantages, returns), with the KL to the initial policy as a reward."""
    value, ref = load_value_model(None, dtype=torch.float32, seed=0), load_model(None, seed=0)
    out = {}
    with torch.no_grad():
        for g in groups:
            for i in range(len(g.responses)):
                v = _token_values(value, g, i).double().tolist()
                kl = (g.logprobs[i].double() - _token_logprobs(ref, g, i).double()).tolist()  # k1
                r = [-ALGO.beta * k for k in kl]
                r[-1] += float(g.rewards[i])
                adv, ret = _gae_by_loop(r, v, ALGO.gamma, ALGO.lam)
                out[g.index, i] = (v, adv, ret)
    return out


def _plain_value_grads(groups, targets, *, weights=None, clip=None) -> dict:
    """0.5 * (V - R)^2 (clipped against the start values when `clip`), the mean over every token of
    the batch, its gradient clipped to norm 0.5: what the critic's optimizer should receive."""
    model = load_value_model(None, dtype=torch.float32, seed=0)
    if weights is not None:
        model.load_state_dict(weights)
    terms, tokens = [], 0
    for g in groups:
        for i in range(len(g.responses)):
            v = _token_values(model, g, i)
            old, _, ret = (torch.tensor(x, dtype=torch.float64) for x in targets[g.index, i])
            loss = (v.double() - ret) ** 2
            if clip is not None:
                clipped = old + (v.double() - old).clamp(-clip, clip)
                loss = torch.maximum(loss, (clipped - ret) ** 2)
            terms.append(0.5 * loss.sum())
            tokens += v.numel()
    (torch.stack(terms).sum() / tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n].double() - b[n].double()).abs().max().item() for n in a)


# ---- the tests ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["on", "off", "padded"])
def test_values_of_micro_batches_equal_one_sequence_at_a_time(groups, mode):
    """Shared-prompt rows, varlen rows and padded rows give each response token the value of the
    unpacked [prompt, response] at the position that predicts it."""
    model = load_value_model(None, dtype=torch.float64, seed=0)  # float32 values of float64 sums (tests/tolerances.py)
    cfg = CriticConfig(shared_prompt=mode, token_budget=24, micro_batch_size=3)
    g = groups[1]
    mbs = micro_batches(cfg, g.prompt_ids, g.responses, pad_id=0, device=torch.device("cpu"))
    assert len(mbs) > 1  # the group splits, so samples land in several micro-batches
    with torch.no_grad():
        plain = [_token_values(model, g, i) for i in range(len(g.responses))]
        for mb in mbs:
            v_NT = mb.values(model)
            for n, i in enumerate(mb.samples):
                R = g.responses[i].numel()
                torch.testing.assert_close(v_NT[n, :R], plain[i].float(), **LOGP_OF_FLOAT64)
                assert not v_NT[n, R:].any()


def test_critic_step_equals_plain_reference(groups):
    """What the critic sends (advantages per token, from values, the KL as a reward and GAE) and the
    gradient its optimizer receives equal the plain computation."""
    assert len({tuple(g.rewards.tolist()) for g in groups}) > 1
    critic = _critic(shared_prompt="on", token_budget=24)
    seen = _recorded(critic.optim)
    metrics, sent = _critic_step(critic, groups)
    targets = _plain_targets(groups)
    assert [g.index for g in sent] == [0, 1, 2, 3] and all(isinstance(g, AdvantagedGroup) for g in sent)
    for g in sent:
        assert torch.equal(g.rewards, groups[g.index].rewards)  # the scored group goes on unchanged
        for i, adv in enumerate(g.advantages):
            assert adv.dtype == torch.float32 and adv.numel() == g.responses[i].numel()
            torch.testing.assert_close(adv.double(), torch.tensor(targets[g.index, i][1], dtype=torch.float64), atol=1e-5, rtol=0)
    expected = _plain_value_grads(groups, targets)
    assert _worst(seen[0][0], expected) < 1e-6
    assert max(x.abs().max().item() for x in expected.values()) > 1e-3  # a real gradient
    assert len(seen) == 1 and metrics.value_clipfrac == 0.0  # one pass: V_old = V, nothing to clip
    assert metrics.reward_kl != 0.0 and -1 < metrics.explained_variance < 1


def test_a_later_epoch_clips_against_the_start_values(groups):
    """epochs=2: the second optimizer step trains the stepped critic on the clipped loss, against the
    values and returns of the step's start."""
    critic = _critic(epochs=2, shared_prompt="off")
    seen = _recorded(critic.optim)
    metrics, _ = _critic_step(critic, groups)
    targets = _plain_targets(groups)
    assert len(seen) == 2
    grads, before = seen[1]
    assert _worst(grads, _plain_value_grads(groups, targets, weights=before, clip=ALGO.vf_clip)) < 1e-6
    assert metrics.value_clipfrac > 0  # vf_clip=0.01 binds after a step at lr 1e-2


def test_critic_arrival_order_changes_no_bit(groups):
    a, b = _critic(), _critic()
    seen_a, seen_b = _recorded(a.optim), _recorded(b.optim)
    shuffled = list(groups)
    random.Random(0).shuffle(shuffled)
    _, sent_a = _critic_step(a, shuffled, schedule=Periodic())
    _, sent_b = _critic_step(b, groups, schedule=Sync())
    assert all(torch.equal(x, y) for ga, gb in zip(sent_a, sent_b) for x, y in zip(ga.advantages, gb.advantages))
    assert all(torch.equal(seen_a[0][0][n], g) for n, g in seen_b[0][0].items())


def _advantaged(groups) -> list[AdvantagedGroup]:
    gen = torch.Generator().manual_seed(0)
    return [AdvantagedGroup(**vars(g), advantages=[torch.randn(r.numel(), generator=gen) + 0.3 for r in g.responses])
            for g in groups]


def _ppo_trainer() -> Trainer:
    trainer = Trainer(config=TrainerConfig(lr=1e-2, grad_clip=0.5), model_path=None, dtype=torch.float32,
                      algorithm=get_algorithm("ppo"), algo_config=PPOConfig(), temperature=T, total_steps=4,
                      token_advantages=True)
    trainer.init(_env("trainer"))
    return trainer


def _trainer_grads(trainer: Trainer, groups, *, schedule) -> dict:
    seen = _recorded(trainer.optim)
    ctx = StepContext(step=0, inbound=Endpoints({"scored": schedule(iter(groups))}), outbound=Endpoints({"weights": _Sent()}),
                      timeline=Timeline(executor="trainer", rank=0))
    trainer.barrier(ctx, trainer.step(ctx))
    return seen[0][0]


def test_trainer_trains_on_per_token_advantages(groups):
    """PPO's policy gradient: the critic's advantages whitened over every token of the batch, the
    clipped surrogate (ratio 1) summed over tokens and divided by the batch's token count."""
    adv_groups = _advantaged(groups)
    trainer = _ppo_trainer()
    assert trainer.consumes(Trainer.scored) is AdvantagedGroup
    got = _trainer_grads(trainer, adv_groups, schedule=Periodic())
    flat = torch.cat([a for g in adv_groups for a in g.advantages]).double()
    mu, std = flat.mean(), flat.std(unbiased=False)
    policy = load_model(None, seed=0)
    terms, tokens = [], 0
    for g in adv_groups:
        for i, adv in enumerate(g.advantages):
            lp = _token_logprobs(policy, g, i)
            a = ((adv.double() - mu) / (std + 1e-6)).float()
            terms.append((-a * torch.exp(lp - lp.detach())).sum())
            tokens += adv.numel()
    (torch.stack(terms).sum() / tokens).backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 0.5)
    expected = {n: p.grad for n, p in policy.named_parameters()}
    assert _worst(got, expected) < 1e-6
    assert max(x.abs().max().item() for x in expected.values()) > 1e-3
    shuffled = list(adv_groups)
    random.Random(1).shuffle(shuffled)
    again = _trainer_grads(_ppo_trainer(), shuffled, schedule=Periodic())
    assert all(torch.equal(again[n], g) for n, g in got.items())  # arrival order changes no bit
