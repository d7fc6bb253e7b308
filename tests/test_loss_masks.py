"""Multi-turn groups: only the model's tokens (RolloutGroup.loss_masks) are trained.

The environment's observation tokens are in the model's input (context) but never get a log-prob,
a gradient, an advantage or a place in a normaliser; GAE passes over them (tidal/algorithms/gae.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tidal.algorithms.gae import gae, token_rewards
from tidal.algorithms.grpo import GRPOConfig
from tidal.algorithms.objective import model_token_advantages
from tidal.algorithms.registry import get_algorithm
from tidal.channels.payloads import AdvantagedGroup, ScoredGroup
from tidal.controller.schedules import Periodic
from tidal.controller.timeline import Timeline
from tidal.executors.base import Endpoints, ExecutorEnv, StepContext
from tidal.modeling.hf import load_model
from tests.tolerances import EQUAL, close_grads
from tidal.executors.trainer.executor import Trainer, TrainerConfig, _per_sample
from tidal.modeling.packing import make_micro_batches, pack_group

torch.set_num_threads(1)
CPU = torch.device("cpu")
TEMP = 0.7
UNBOUNDED = 10 ** 6


# ---- GAE over masks with holes ------------------------------------------------------------------

# row 0: model 2 tokens, environment 2, model 2; row 1: model 1, environment 1, model 1, then an
# environment token and padding (both False: the reward goes on the last model token, column 2)
HOLES = torch.tensor([[True, True, False, False, True, True],
                      [True, False, True, False, False, False]])
HOLE_VALUES = torch.tensor([[0.5, 0.25, 9.0, 9.0, -0.5, 1.0],
                            [0.125, 9.0, 0.75, 9.0, 9.0, 9.0]])  # the 9s (holes, padding) must not leak in
HOLE_REWARDS = torch.tensor([1.0, -2.0])


def test_token_rewards_sit_on_the_last_model_token():
    r = token_rewards(HOLE_REWARDS, HOLES, kl_NT=torch.full((2, 6), 0.5), beta=0.5)
    # -0.25 on every model token, the reward on the last True (row 1: column 2, not 5)
    assert r.tolist() == [[-0.25, -0.25, 0, 0, -0.25, 0.75], [-0.25, 0, -2.25, 0, 0, 0]]


def test_gae_with_holes_by_hand():
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    adv, ret = gae(token_rewards(HOLE_REWARDS, HOLES), HOLE_VALUES, HOLES, gamma=gamma, lam=lam)
    # row 0, backwards (V after the last token = A after it = 0):
    #   t=5: delta = 1 + 0.9*0 - 1.0 = 0.0                    A5 = 0.0
    #   t=4: delta = 0 + 0.9*1.0 - (-0.5) = 1.4              A4 = 1.4 + 0.72*0.0 = 1.4
    #   t=3, t=2: holes: A = 0, and V_next = -0.5, A_next = 1.4 pass through to t=1
    #   t=1: delta = 0 + 0.9*(-0.5) - 0.25 = -0.7            A1 = -0.7 + 0.72*1.4 = 0.308
    #   t=0: delta = 0 + 0.9*0.25 - 0.5 = -0.275             A0 = -0.275 + 0.72*0.308 = -0.05324
    # row 1: t=5..3 are False (nothing yet); t=2: delta = -2 + 0 - 0.75 = -2.75, A2 = -2.75;
    #   t=1 hole; t=0: delta = 0 + 0.9*0.75 - 0.125 = 0.55  A0 = 0.55 + 0.72*(-2.75) = -1.43
    expect_adv = torch.tensor([[-0.05324, 0.308, 0, 0, 1.4, 0.0],
                               [-1.43, 0, -2.75, 0, 0, 0]], dtype=torch.float64)
    # returns A + V on model tokens, 0 on holes and padding
    expect_ret = torch.tensor([[0.44676, 0.558, 0, 0, 0.9, 1.0],
                               [-1.305, 0, -2.0, 0, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expect_adv)
    torch.testing.assert_close(ret, expect_ret)


def test_gae_with_holes_equals_gae_of_the_model_tokens_alone():
    """Passing over a hole is GAE on the response with its environment tokens cut out."""
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(5, 12, generator=g) < 0.6
    mask[:, 0] = True
    mask[1, 7:] = False  # padding too
    values, rewards = torch.randn(5, 12, generator=g), torch.randn(5, generator=g)
    kl = torch.rand(5, 12, generator=g)
    adv, ret = gae(token_rewards(rewards, mask, kl_NT=kl, beta=0.1), values, mask, gamma=0.97, lam=0.9)
    assert bool((adv[~mask] == 0).all() and (ret[~mask] == 0).all())
    for n in range(5):
        m = mask[n]
        K = int(m.sum())
        one = torch.ones(1, K, dtype=torch.bool)
        a, r = gae(token_rewards(rewards[n:n + 1], one, kl_NT=kl[n, m][None], beta=0.1), values[n, m][None], one,
                   gamma=0.97, lam=0.9)
        torch.testing.assert_close(adv[n, m], a[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ret[n, m], r[0], rtol=1e-12, atol=1e-12)
    assert bool((~mask[:, :-1] & mask[:, 1:]).any())  # a hole before a model token: not just padding


# ---- micro-batches: environment tokens are context only ------------------------------------------

def _multi_turn(*, vocab: int, P: int, turns, seed: int = 0):
    """A prompt and responses made of alternating (model, environment) runs: turns[i] = run lengths,
    the first the model's; returns prompt, responses, loss masks."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (P,), generator=g)
    responses, masks = [], []
    for runs in turns:
        masks.append(torch.cat([torch.full((n,), k % 2 == 0) for k, n in enumerate(runs)]).bool())
        responses.append(torch.randint(0, vocab, (masks[-1].numel(),), generator=g))
    return prompt, responses, masks


# G=4: holes in the middle, a trailing observation, a one-turn response, and one that is all model
TURNS = [(3, 2, 4), (2, 3, 1, 2), (5,), (1, 1, 1, 1, 1)]


def _plain_logp(model, prompt, resp):
    """log_softmax(logits / T) of each response token from a plain forward of [prompt, response]."""
    P = prompt.numel()
    logits = model(input_ids=torch.cat([prompt, resp])[None]).logits[0, P - 1: -1]
    logits = (logits if logits.dtype == torch.float64 else logits.float()) / TEMP
    return torch.log_softmax(logits, -1).gather(-1, resp[:, None])[:, 0]


def _mbs(mode, prompt, responses, masks, *, token_budget=UNBOUNDED, backend="auto"):
    return make_micro_batches(prompt, responses, mode=mode, token_budget=token_budget, micro_batch_size=3, pad_id=0,
                              device=CPU, backend=backend, loss_masks=masks)


def _logp_GT(model, mbs, *, G: int, T: int, weights=None) -> torch.Tensor:
    """Each micro-batch's rows in group order [G, T]; with `weights` [G, T], backward of sum(logp * w)."""
    out = torch.zeros(G, T, dtype=torch.float64 if model.dtype == torch.float64 else torch.float32)
    for mb in mbs:
        logp_NT = mb.logprobs(model, temperature=TEMP)
        idx = list(mb.samples)
        if weights is not None:
            (logp_NT * weights[idx, : logp_NT.shape[1]]).sum().backward()
        out[idx, : logp_NT.shape[1]] = logp_NT.detach()
    return out


def _grads(model) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("mode", ["padded", "on", "off"])
def test_environment_tokens_get_no_logprob_and_no_gradient(mode):
    model = load_model(None, seed=1).double()  # the same math in another order: float64 and EQUAL
    prompt, responses, masks = _multi_turn(vocab=model.config.vocab_size, P=6, turns=TURNS)
    G, T = len(responses), max(r.numel() for r in responses)
    mask_GT = torch.nn.utils.rnn.pad_sequence(masks, batch_first=True)
    mbs = _mbs(mode, prompt, responses, masks)
    for mb in mbs:  # the head sees the model's tokens only
        assert torch.equal(mb.mask_NT, mask_GT[list(mb.samples), : mb.mask_NT.shape[1]])
        if mode != "padded":
            assert mb.rows_K.numel() == int(mb.mask_NT.sum())
    # the loss weighs every position, environment ones hugely: their gradient must still be exactly 0
    w_GT = torch.linspace(-1.0, 2.0, G)[:, None] + 0.1 * torch.arange(T)
    got_GT = _logp_GT(model, mbs, G=G, T=T, weights=torch.where(mask_GT, w_GT, 1e6))
    got = _grads(model)
    _logp_GT(model, mbs, G=G, T=T, weights=torch.where(mask_GT, w_GT, 0.0))
    assert all(torch.equal(a, b) for a, b in zip(got, _grads(model)))
    assert bool((got_GT[~mask_GT] == 0).all())
    # an independent plain forward of each full sequence, summed over the model's tokens only
    for i, (resp, m) in enumerate(zip(responses, masks)):
        plain = _plain_logp(model, prompt, resp)
        torch.testing.assert_close(got_GT[i, : resp.numel()][m], plain[m].detach(), **EQUAL)
        (plain[m] * w_GT[i, : resp.numel()][m]).sum().backward()
    ref = _grads(model)
    assert close_grads(got, ref)
    assert max(g.abs().max().item() for g in ref) > 1e-2  # a real gradient


@pytest.mark.parametrize("backend", ["blocks", "dense"])
@pytest.mark.parametrize("mode", ["on", "off"])
def test_packed_multi_turn_equals_padded_rows(mode, backend):
    model = load_model(None, seed=1).double()  # the same math in another order: float64 and EQUAL
    prompt, responses, masks = _multi_turn(vocab=model.config.vocab_size, P=7, turns=TURNS, seed=1)
    G, T = len(responses), max(r.numel() for r in responses)
    mask_GT = torch.nn.utils.rnn.pad_sequence(masks, batch_first=True)
    w_GT = torch.linspace(-1.0, 2.0, G)[:, None] + 0.1 * torch.arange(T)
    ref_GT = _logp_GT(model, _mbs("padded", prompt, responses, masks), G=G, T=T, weights=w_GT)
    ref = _grads(model)
    # one row, and a budget that splits the group in two (by sample index)
    for budget in (UNBOUNDED, 25 if mode == "on" else 31):
        mbs = _mbs(mode, prompt, responses, masks, token_budget=budget, backend=backend)
        assert len(mbs) == (1 if budget == UNBOUNDED else 2)
        got_GT = _logp_GT(model, mbs, G=G, T=T, weights=w_GT)
        assert torch.allclose(got_GT, ref_GT, **EQUAL) and bool((got_GT[~mask_GT] == 0).all())
        assert close_grads(_grads(model), ref)
    # the masks change which tokens count, not the log-prob of a model token (the context is the same)
    full_GT = _logp_GT(model, _mbs(mode, prompt, responses, None, backend=backend), G=G, T=T)
    assert torch.allclose(full_GT[mask_GT], ref_GT[mask_GT], **EQUAL)
    assert bool((full_GT[~mask_GT & (torch.arange(T) < torch.tensor([r.numel() for r in responses])[:, None])]
                 != 0).all())


def test_rows_by_hand():
    # shared prompt [5, 6]; response 0 = 7 (model) 8 (environment) 9 (model), response 1 = 4 (model)
    masks = [torch.tensor([True, False, True]), torch.tensor([True])]
    (mb,) = pack_group(torch.tensor([5, 6]), [torch.tensor([7, 8, 9]), torch.tensor([4])], token_budget=UNBOUNDED,
                       pad_id=0, device=CPU, shared_prompt=True, loss_masks=masks)
    assert mb.input_ids_1L.tolist() == [[5, 6, 7, 8, 9, 4]]  # the observation 8 is still input
    assert mb.rows_K.tolist() == [1, 3, 1]  # 7 <- prompt end, 9 <- 8, 4 <- prompt end; nothing predicts 8
    assert mb.mask_NT.tolist() == [[True, False, True], [True, False, False]]
    (mb,) = pack_group(torch.tensor([5, 6]), [torch.tensor([7, 8, 9]), torch.tensor([4])], token_budget=UNBOUNDED,
                       pad_id=0, device=CPU, shared_prompt=False, loss_masks=masks)
    assert mb.input_ids_1L.tolist() == [[5, 6, 7, 8, 9, 5, 6, 4]] and mb.rows_K.tolist() == [1, 3, 6]


def test_bad_loss_masks_are_refused():
    prompt, responses = torch.tensor([1, 2]), [torch.tensor([3, 4]), torch.tensor([5])]
    for mode in ("padded", "on"):
        with pytest.raises(ValueError, match="loss masks for"):
            _mbs(mode, prompt, responses, [torch.tensor([True, True])])
        with pytest.raises(ValueError, match="loss mask 1"):
            _mbs(mode, prompt, responses, [torch.tensor([True, True]), torch.tensor([True, False])])
        with pytest.raises(ValueError, match="must be bool"):
            _mbs(mode, prompt, responses, [torch.tensor([1, 1]), torch.tensor([1])])


# ---- the trainer ---------------------------------------------------------------------------------

def _scored(index: int, *, vocab: int, seed: int) -> ScoredGroup:
    prompt, responses, masks = _multi_turn(vocab=vocab, P=5, turns=TURNS[:3], seed=seed)
    rewards = torch.tensor([1.0, 0.0, 0.5]) + 0.25 * index
    return ScoredGroup(step=0, index=index, prompt="p", extras={}, prompt_ids=prompt, responses=responses,
                       logprobs=[torch.zeros(r.numel()) for r in responses], finished=torch.ones(3, dtype=torch.bool),
                       rewards=rewards, reward_failures=0, loss_masks=masks)


class _Pushed:
    bytes_per_push = 0  # what a WEIGHTS port reports (tidal/controller/world.py Outlet)
    def push(self, shards, specs):
        pass

    def flush(self):
        pass


def test_trainer_step_trains_only_the_model_tokens():
    """A GRPO step on multi-turn groups equals plain GRPO whose token means run over the model's tokens."""
    beta, clip_low, clip_high = 0.04, 0.2, 0.28
    vocab = load_model(None, seed=0).config.vocab_size
    groups = [_scored(i, vocab=vocab, seed=10 + i) for i in range(2)]
    trainer = Trainer(config=TrainerConfig(lr=1e-2, micro_batch_size=2, grad_clip=0.5), model_path=None,
                      dtype=torch.float32, algorithm=get_algorithm("grpo"),
                      algo_config=GRPOConfig(beta=beta, clip_low=clip_low, clip_high=clip_high), temperature=TEMP,
                      total_steps=4)
    trainer.init(ExecutorEnv(name="trainer", ranks=(0,), units=((0,),), rank=0, group=None,
                             device=CPU, seed=0, output_dir=Path("/nonexistent")))
    seen = {}
    names = {id(p): n for n, p in trainer.models.master.named_parameters()}
    trainer.optim.opt.register_step_pre_hook(lambda opt, *_: seen.update(
        {names[id(p)]: p.grad.clone() for group in opt.param_groups for p in group["params"]}))
    ctx = StepContext(step=0, inbound=Endpoints({"scored": Periodic()(iter(groups))}),
                      outbound=Endpoints({"weights": _Pushed()}), timeline=Timeline(executor="trainer", rank=0))
    trainer.barrier(ctx, trainer.step(ctx))

    policy, ref = load_model(None, seed=0), load_model(None, seed=0)
    terms = []
    for g in groups:
        r = g.rewards.double()
        adv = ((r - r.mean()) / (r.std(unbiased=False) + 1e-6)).float()
        for i, (resp, m) in enumerate(zip(g.responses, g.loss_masks)):
            lp = _plain_logp(policy, g.prompt_ids, resp)[m]
            with torch.no_grad():
                lr_ = _plain_logp(ref, g.prompt_ids, resp)[m]
            ratio = torch.exp(lp - lp.detach())
            pg = -torch.minimum(ratio * adv[i], ratio.clamp(1 - clip_low, 1 + clip_high) * adv[i])
            terms.append((pg + beta * (torch.exp(lr_ - lp) - (lr_ - lp) - 1)).mean())
    torch.stack(terms).mean().backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 0.5)
    expected = {n: p.grad for n, p in policy.named_parameters()}
    assert seen.keys() == expected.keys()
    worst = max((seen[n] - g).abs().max().item() for n, g in expected.items())
    assert worst < 1e-6, worst
    assert max(g.abs().max().item() for g in expected.values()) > 1e-3


def test_token_advantages_average_and_whiten_over_model_tokens():
    masks = [torch.tensor([True, False, True]), torch.tensor([False, True])]
    adv = [torch.tensor([1.0, 7.0, 4.0]), torch.tensor([5.0, -2.0])]
    g = AdvantagedGroup(step=0, index=0, prompt="p", extras={}, prompt_ids=torch.tensor([1]),
                        responses=[torch.tensor([1, 2, 3]), torch.tensor([4, 5])], logprobs=[], finished=torch.ones(2),
                        rewards=torch.zeros(2), reward_failures=0, advantages=adv, loss_masks=masks)
    assert model_token_advantages(g).tolist() == [1.0, 4.0, -2.0]  # the batch moments see these only
    padded = torch.nn.utils.rnn.pad_sequence(adv, batch_first=True)
    assert _per_sample(padded, g).tolist() == [2.5, -2.0]
    g.loss_masks = None  # single-turn: every token, as before
    assert _per_sample(padded, g).tolist() == [4.0, 1.5]


# ---- the critic ----------------------------------------------------------------------------------

def test_critic_advantages_and_value_loss_skip_the_environment_tokens():
    """The critic's advantages equal plain GAE over each response's model tokens alone (the KL in the
    reward too), 0 on the environment's; the value loss trains on the model tokens alone."""
    from tidal.algorithms.ppo import PPOConfig
    from tidal.executors.critic.config import CriticConfig
    from tidal.executors.critic.executor import Critic
    from tidal.executors.critic.model import load_value_model

    algo = PPOConfig(beta=0.05, gamma=0.9, lam=0.8, vf_clip=0.01)
    vocab = load_model(None, seed=0).config.vocab_size
    groups = [_scored(i, vocab=vocab, seed=20 + i) for i in range(2)]
    critic = Critic(config=CriticConfig(lr=1e-2, grad_clip=0.5, shared_prompt="on"), model_path=None,
                    dtype=torch.float32, algo_config=algo, temperature=TEMP, total_steps=4)
    critic.init(ExecutorEnv(name="critic", ranks=(0,), units=((0,),), rank=0, group=None, device=CPU, seed=0,
                            output_dir=Path("/nonexistent")))
    seen = {}
    names = {id(p): n for n, p in critic.optim.model.named_parameters()}
    critic.optim.opt.register_step_pre_hook(lambda opt, *_: seen.update(
        {names[id(p)]: p.grad.clone() for group in opt.param_groups for p in group["params"]}))

    class Sent(_Pushed):
        items = []

        def send(self, item):
            self.items.append(item)

    ctx = StepContext(step=0, inbound=Endpoints({"scored": Periodic()(iter(groups))}),
                      outbound=Endpoints({"advantaged": Sent()}), timeline=Timeline(executor="critic", rank=0))
    critic.barrier(ctx, critic.step(ctx))
    sent = sorted(Sent.items, key=lambda g: g.index)

    value, ref = load_value_model(None, dtype=torch.float32, seed=0), load_model(None, seed=0)
    terms, tokens = [], 0
    for g, out in zip(groups, sent):
        P = g.prompt_ids.numel()
        for i, (resp, m) in enumerate(zip(g.responses, g.loss_masks)):
            v = value(input_ids=torch.cat([g.prompt_ids, resp])[None]).logits[0, P - 1: -1, 0][m]
            with torch.no_grad():
                kl = g.logprobs[i][m].double() - _plain_logp(ref, g.prompt_ids, resp)[m].double()  # k1
            r = -algo.beta * kl
            r[-1] += float(g.rewards[i])
            vd, adv, last = v.detach().double(), torch.zeros_like(r), 0.0  # GAE by a loop over the model tokens alone
            for t in reversed(range(len(r))):
                nxt = float(vd[t + 1]) if t + 1 < len(r) else 0.0
                last = float(r[t]) + algo.gamma * nxt - float(vd[t]) + algo.gamma * algo.lam * last
                adv[t] = last
            torch.testing.assert_close(out.advantages[i][m].double(), adv, atol=1e-5, rtol=0)
            assert bool((out.advantages[i][~m] == 0).all())
            terms.append(0.5 * ((v.double() - (adv + vd)) ** 2).sum())
            tokens += int(m.sum())
    (torch.stack(terms).sum() / tokens).backward()
    torch.nn.utils.clip_grad_norm_(value.parameters(), 0.5)
    expected = {n: p.grad for n, p in value.named_parameters()}
    assert seen.keys() == expected.keys()
    assert max((seen[n] - e).abs().max().item() for n, e in expected.items()) < 1e-6
    assert max(e.abs().max().item() for e in expected.values()) > 1e-3
