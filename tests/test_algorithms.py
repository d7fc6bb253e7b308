"""Every algorithm against values worked out by hand, and the invariances the streaming trainer needs."""
import dataclasses
import math

import pytest
import torch

from tidal.algorithms.base import Algorithm, LossInputs
from tidal.algorithms.batch_scope import (batch_mean_scale, batch_normalise, batch_normalise_at_barrier, linear_passes,
                                    score_moments)
from tidal.algorithms.dapo import DAPO, DAPOConfig, keeps_group, overlong_penalty
from tidal.algorithms.dr_grpo import DR_GRPO, DrGRPOConfig
from tidal.algorithms.grpo import GRPO, GRPOConfig
from tidal.algorithms.gspo import GSPO, GSPOConfig
from tidal.algorithms.kl import kl_in_reward, kl_k1, kl_k2, kl_k3, kl_penalised_rewards
from tidal.algorithms.registry import ALGORITHMS
from tidal.algorithms.reinforce_pp import REINFORCE_PP, ReinforcePPConfig
from tidal.algorithms.rloo import RLOO, RLOOConfig

torch.set_num_threads(1)
F64 = torch.float64
LN2, LN15, LN05 = math.log(2.0), math.log(1.5), math.log(0.5)


def _two_sequences(adv=(1.0, -2.0), invert_ratio=False):
    """Seq 0: 3 tokens, ratios [1, 1.5, 0.5], ref - logp = [0, ln2, -ln2].
    Seq 1: 2 tokens + 1 pad, ratios [0.5, 1.5], ref - logp = [ln2, 0]. invert_ratio: ratios 1/r."""
    pad = float("nan")
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, pad]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.0, -1.0 - LN15, -1.0 - LN05], [-2.0 - LN05, -2.0 - LN15, pad]], dtype=F64)
    if invert_ratio:
        old = 2 * logp.detach() - old
    ref = torch.tensor([[-1.0, -1.0 + LN2, -1.0 - LN2], [-2.0 + LN2, -2.0, pad]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    inputs = LossInputs(logp_NT=logp, old_logp_NT=old, ref_logp_NT=ref, adv_N=torch.tensor(adv, dtype=F64),
                        mask_NT=mask)
    return logp, inputs


def _loss_and_grad(algo, inputs, cfg):
    out = algo.loss(inputs, cfg)
    out.loss_sum.backward()
    return out, inputs.logp_NT.grad


# k3 per token of the fixture: k3(0) = 0, k3(ln2) = 1 - ln2, k3(-ln2) = ln2 - 0.5; d k3 / d logp = 1 - e^d.
K3_SEQ0, K3_SEQ1 = 0.5, 1 - LN2  # token sums


# ---- KL ----------------------------------------------------------------------------------------
def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -1.0, -1.0], dtype=F64)
    ref = torch.tensor([-1.0 + LN2, -1.0 - LN2, -1.0], dtype=F64)  # log r = ref - logp = [ln2, -ln2, 0]
    assert torch.allclose(kl_k1(logp, ref), torch.tensor([-LN2, LN2, 0.0], dtype=F64))
    assert torch.allclose(kl_k2(logp, ref), torch.tensor([LN2 ** 2 / 2, LN2 ** 2 / 2, 0.0], dtype=F64))
    # k3 = r - 1 - log r: r = 2 -> 1 - ln2; r = 1/2 -> -1/2 + ln2
    assert torch.allclose(kl_k3(logp, ref), torch.tensor([1 - LN2, LN2 - 0.5, 0.0], dtype=F64))


def test_kl_in_reward_by_hand():
    _, x = _two_sequences()
    rewards = torch.tensor([1.0, 0.0], dtype=F64)
    for est, (kl0, kl1) in {"k1": (0.0, -LN2), "k2": (LN2 ** 2, LN2 ** 2 / 2), "k3": (K3_SEQ0, K3_SEQ1)}.items():
        cfg = GRPOConfig(beta=0.1, kl_estimator=est, kl_in="reward")
        got = kl_penalised_rewards(rewards_N=rewards, logp_NT=x.logp_NT, ref_logp_NT=x.ref_logp_NT,
                                   mask_NT=x.mask_NT, cfg=cfg)
        assert torch.allclose(got, torch.tensor([1.0 - 0.1 * kl0, -0.1 * kl1], dtype=F64), atol=1e-12), est
        assert not got.requires_grad and kl_in_reward(cfg)


def test_grpo_defaults_unchanged_and_kl_options():
    cfg = GRPOConfig()
    assert (cfg.beta, cfg.kl_estimator, cfg.kl_in, cfg.clip_low, cfg.clip_high) == (0.0, "k3", "loss", 0.2, 0.2)
    # kl_in="reward": the loss carries no KL (and needs no reference), yet still reports it.
    logp, x = _two_sequences()
    out, grad = _loss_and_grad(GRPO, x, GRPOConfig(beta=0.1, kl_in="reward"))
    assert out.loss_sum.item() == pytest.approx(-0.9 + 2.3, abs=1e-12)  # pg only, as in test_grpo
    assert out.stats["kl"].total == pytest.approx(K3_SEQ0 / 3 + K3_SEQ1 / 2)
    GRPO.loss(LossInputs(logp_NT=x.logp_NT, old_logp_NT=x.old_logp_NT, ref_logp_NT=None, adv_N=x.adv_N,
                         mask_NT=x.mask_NT), GRPOConfig(beta=0.1, kl_in="reward"))
    # k1 in the loss: per-token k1 = logp - ref = [0, -ln2, ln2] / [-ln2, 0], gradient 1 per real token.
    logp, x = _two_sequences()
    out, grad = _loss_and_grad(GRPO, x, GRPOConfig(beta=0.1, kl_estimator="k1"))
    assert out.loss_sum.item() == pytest.approx(1.4 + 0.1 * (0.0 - LN2 / 2), abs=1e-12)
    expected = torch.tensor([[-1 / 3 + 0.1 / 3, 0.1 / 3, -0.5 / 3 + 0.1 / 3], [0.1 / 2, 3 / 2 + 0.1 / 2, 0]], dtype=F64)
    assert torch.allclose(grad, expected, atol=1e-12)


def test_entropy_bonus_by_hand():
    """entropy_coef=c: each token's loss less c * H, summed as the surrogate is (Dr. GRPO: a plain token sum), its
    gradient -c on H; GSPO's per-sequence loss refuses it, and a loss without the entropy names what is missing."""
    H = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.25, float("nan")]], dtype=F64, requires_grad=True)
    logp, x = _two_sequences()
    plain = DR_GRPO.loss(x, DrGRPOConfig(max_response_tokens=4)).loss_sum
    out = DR_GRPO.loss(dataclasses.replace(x, entropy_NT=H), DrGRPOConfig(max_response_tokens=4, entropy_coef=0.1))
    assert out.loss_sum.item() == pytest.approx(plain.item() - 0.1 * (6.0 + 0.75), abs=1e-12)
    out.loss_sum.backward()
    assert torch.allclose(H.grad, torch.tensor([[-0.1] * 3, [-0.1, -0.1, 0.0]], dtype=F64), atol=1e-15)
    with pytest.raises(ValueError, match="entropy"):
        DR_GRPO.loss(x, DrGRPOConfig(max_response_tokens=4, entropy_coef=0.1))
    with pytest.raises(ValueError, match="entropy_coef: gspo's ratio is per sequence"):
        GSPOConfig(entropy_coef=0.1)
    assert not GRPOConfig().needs_entropy and GRPOConfig(entropy_coef=0.01).needs_entropy


# ---- Dr. GRPO ----------------------------------------------------------------------------------
def test_dr_grpo_by_hand():
    cfg = DrGRPOConfig(beta=0.1, max_response_tokens=4)
    assert DR_GRPO.advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), cfg).tolist() == [0.5, -0.5, -0.5, 0.5]
    assert DR_GRPO.advantages(torch.tensor([3.0, 1.0, 2.0]), cfg).tolist() == [1.0, -1.0, 0.0]  # no std
    logp, x = _two_sequences()
    out, grad = _loss_and_grad(DR_GRPO, x, cfg)
    # Token pg, A=+1: -1, -1.2 (high clip), -0.5; A=-2: 1.6 (low clip), 3.  Plain token sum = 1.9.
    assert out.loss_sum.item() == pytest.approx(1.9 + 0.1 * (K3_SEQ0 + K3_SEQ1), abs=1e-12)
    assert out.denom == 2 * 4  # N * max_response_tokens, whatever the lengths
    assert out.stats["clip_frac"].total == 2.0  # token counts under a constant normaliser
    # No 1/|o_i|: pg grad -ratio*A (0 where clamped) + 0.1 * (1 - e^d).
    expected = torch.tensor([[-1.0, -0.1, -0.5 + 0.05], [-0.1, 3.0, 0.0]], dtype=F64)
    assert torch.allclose(grad, expected, atol=1e-12)
    with pytest.raises(ValueError, match="max_response_tokens=2"):
        DR_GRPO.loss(_two_sequences()[1], DrGRPOConfig(max_response_tokens=2))


# ---- DAPO --------------------------------------------------------------------------------------
def test_dapo_by_hand():
    cfg = DAPOConfig()
    assert (cfg.clip_low, cfg.clip_high, cfg.beta, cfg.dynamic_sampling) == (0.2, 0.28, 0.0, True)
    a = 0.5 / 0.500001  # GRPO's group advantages: mean 0.5, population std 0.5
    assert torch.allclose(DAPO.advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), cfg), torch.tensor([a, -a, -a, a]))
    logp, x = _two_sequences()
    out, grad = _loss_and_grad(DAPO, x, cfg)
    # A=+1: -1, -min(1.5, 1.28) = -1.28, -0.5; A=-2: 2 * max(0.5, 0.8) = 1.6, 2 * max(1.5, 1.28) = 3.
    assert out.loss_sum.item() == pytest.approx(1.82, abs=1e-12)
    assert out.denom == 5.0  # real tokens: the batch mean is over tokens, not sequences
    assert (out.stats["clip_high_frac"].total, out.stats["clip_low_frac"].total) == (1.0, 1.0)
    assert torch.allclose(grad, torch.tensor([[-1.0, 0.0, -0.5], [0.0, 3.0, 0.0]], dtype=F64), atol=1e-12)


def test_clip_higher_lets_a_ratio_of_1_25_through():
    for algo, cfg, value, slope in [(DAPO, DAPOConfig(), -1.25, -1.25), (GRPO, GRPOConfig(), -1.2, 0.0)]:
        logp = torch.tensor([[0.0]], dtype=F64, requires_grad=True)
        x = LossInputs(logp_NT=logp, old_logp_NT=torch.tensor([[-math.log(1.25)]], dtype=F64), ref_logp_NT=None,
                       adv_N=torch.tensor([1.0], dtype=F64), mask_NT=torch.ones(1, 1, dtype=torch.bool))
        out, grad = _loss_and_grad(algo, x, cfg)
        assert out.loss_sum.item() == pytest.approx(value) and grad.item() == pytest.approx(slope)


def test_overlong_penalty_values():
    lengths = torch.tensor([3, 6, 7, 9, 10, 11])
    # L = 10, C = 4: free up to 6, then (6 - |o|) / 4, -1 at and beyond 10.
    assert overlong_penalty(lengths, max_tokens=10, buffer=4).tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    assert overlong_penalty(lengths, max_tokens=10, buffer=4, factor=0.5).tolist() == [0, 0, -0.125, -0.375, -0.5, -0.5]
    assert overlong_penalty(lengths, max_tokens=10, buffer=0).tolist() == [0.0] * 6
    with pytest.raises(ValueError):
        overlong_penalty(lengths, max_tokens=10, buffer=11)
    cfg = DAPOConfig(max_response_tokens=10, overlong_buffer=4)
    shaped = DAPO.shape_rewards(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([2, 8, 10]), cfg)
    assert shaped.tolist() == [1.0, 0.5, -1.0]
    with pytest.raises(ValueError, match="max_response_tokens=10"):
        DAPO.shape_rewards(torch.tensor([1.0]), torch.tensor([11]), cfg)
    with pytest.raises(ValueError):
        DAPOConfig(max_response_tokens=10, overlong_buffer=11)
    assert GRPO.shape_rewards(torch.tensor([1.0]), torch.tensor([99]), GRPOConfig()).tolist() == [1.0]


def test_dynamic_sampling_predicate():
    assert not keeps_group(torch.tensor([1.0, 1.0, 1.0]))
    assert not keeps_group(torch.tensor([0.0, 0.0]))
    assert not keeps_group(torch.tensor([1.0]))
    assert keeps_group(torch.tensor([1.0, 0.0]))
    assert keeps_group(torch.tensor([0.5, 0.5, 0.7]))
    assert not DAPO.keeps_group(torch.tensor([1.0, 1.0]), DAPOConfig())
    assert DAPO.keeps_group(torch.tensor([1.0, 1.0]), DAPOConfig(dynamic_sampling=False))
    assert GRPO.keeps_group(torch.tensor([1.0, 1.0]), GRPOConfig())  # only DAPO filters
    with pytest.raises(ValueError):
        keeps_group(torch.tensor([]))


# ---- RLOO --------------------------------------------------------------------------------------
def test_rloo_by_hand():
    cfg = RLOOConfig()
    # r_i minus the mean of the other three: 1 - 1/3, 0 - 2/3, ...
    assert torch.allclose(RLOO.advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), cfg),
                          torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert RLOO.advantages(torch.tensor([3.0, 0.0, 0.0]), cfg).tolist() == [3.0, -1.5, -1.5]
    assert RLOO.advantages(torch.tensor([0.3, 0.3]), cfg).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="at least 2"):
        RLOO.advantages(torch.tensor([1.0]), cfg)
    logp, x = _two_sequences()
    out, grad = _loss_and_grad(RLOO, x, cfg)
    assert out.loss_sum.item() == pytest.approx(1.9, abs=1e-12)  # token SUM per sequence (log pi(o))
    assert out.denom == 2.0
    assert out.stats["clip_high_frac"].total == pytest.approx(1 / 3)
    assert out.stats["clip_low_frac"].total == pytest.approx(1 / 2)
    assert torch.allclose(grad, torch.tensor([[-1.0, 0.0, -0.5], [0.0, 3.0, 0.0]], dtype=F64), atol=1e-12)


# ---- REINFORCE++ -------------------------------------------------------------------------------
def test_reinforce_pp_scores_and_batch_statistics_by_hand():
    plain, base = ReinforcePPConfig(), ReinforcePPConfig(baseline=True)
    g0, g1 = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert REINFORCE_PP.advantages(g0, plain).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert REINFORCE_PP.advantages(g1, base).tolist() == [0.25, 0.25, 0.25, -0.75]
    # plain: 8 scores, sum 5 -> mu 0.625, E[s^2] = 0.625, var = 0.625 - 0.390625 = 0.234375
    mu, c = batch_mean_scale({1: score_moments(g1), 0: score_moments(g0)}, eps=1e-6)
    assert mu == pytest.approx(0.625) and c == pytest.approx(1 / (math.sqrt(0.234375) + 1e-6))
    # baseline: [.5, -.5, -.5, .5, .25, .25, .25, -.75] -> mu 0, var (1 + 3/16 + 9/16) / 8 = 0.21875
    s = {0: score_moments(REINFORCE_PP.advantages(g0, base)), 1: score_moments(REINFORCE_PP.advantages(g1, base))}
    mu, c = batch_mean_scale(s, eps=1e-6)
    assert mu == pytest.approx(0.0, abs=1e-15) and c == pytest.approx(1 / (math.sqrt(0.21875) + 1e-6))
    # All scores equal: no signal, scale exactly 0 (not rounding dust / eps).
    assert batch_mean_scale({0: score_moments(torch.tensor([0.1, 0.1])), 1: score_moments(torch.tensor([0.1]))},
                            eps=1e-6)[1] == 0.0
    assert batch_normalise(torch.tensor([1.0, 3.0]), mu=2.0, scale=0.5).tolist() == [-0.5, 0.5]
    with pytest.raises(ValueError):
        batch_mean_scale({}, eps=1e-6)


def test_reinforce_pp_loss_and_barrier_helpers_by_hand():
    logp, x = _two_sequences()
    out, grad = _loss_and_grad(REINFORCE_PP, x, ReinforcePPConfig())
    assert out.loss_sum.item() == pytest.approx(1.9, abs=1e-12) and out.denom == 5.0
    assert torch.allclose(grad, torch.tensor([[-1.0, 0.0, -0.5], [0.0, 3.0, 0.0]], dtype=F64), atol=1e-12)
    # c*3 - c*mu*2 + (1 - c + c*mu)*0.5 with c = 0.5, mu = 1
    assert batch_normalise_at_barrier(at_score=3.0, at_one=2.0, at_zero=0.5, mu=1.0, scale=0.5) == 1.0
    assert batch_normalise_at_barrier(at_score=3.0, at_one=2.0, mu=1.0, scale=0.5) == 0.5
    # Two one-token groups with scores 1 and 3 (mu 2, sigma 1): A = [-c, c], c = 1/(1 + 1e-6), and
    # with ratio 1 the token-sum loss is -sum_i A_i, so d/dlogp = [c, -c]. From the two passes:
    # grad L(s) = [-1, -3], grad L(1) = [-1, -1] -> c * [-1, -3] - 2c * [-1, -1] = [c, -c].
    mu, c = batch_mean_scale({0: score_moments(torch.tensor([1.0])), 1: score_moments(torch.tensor([3.0]))}, eps=1e-6)
    assert (mu, c) == (2.0, 1 / (1 + 1e-6))
    logp = torch.tensor([[-1.0], [-2.0]], dtype=F64, requires_grad=True)
    grads = {}
    for name, adv in linear_passes(torch.tensor([1.0, 3.0], dtype=F64), ReinforcePPConfig()).items():
        out = REINFORCE_PP.loss(LossInputs(logp_NT=logp, old_logp_NT=logp.detach(), ref_logp_NT=None, adv_N=adv,
                                           mask_NT=torch.ones(2, 1, dtype=torch.bool)), ReinforcePPConfig())
        grads[name] = torch.autograd.grad(out.loss_sum, logp)[0]
    assert set(grads) == {"score", "one"}  # no KL in the loss -> no zero pass
    assert grads["score"].flatten().tolist() == [-1.0, -3.0] and grads["one"].flatten().tolist() == [-1.0, -1.0]
    got = batch_normalise_at_barrier(at_score=grads["score"], at_one=grads["one"], mu=mu, scale=c)
    assert torch.allclose(got.flatten(), torch.tensor([c, -c], dtype=F64), atol=1e-15)
    assert set(linear_passes(torch.ones(2), ReinforcePPConfig(beta=0.1))) == {"score", "one", "zero"}


# ---- GSPO --------------------------------------------------------------------------------------
def test_gspo_by_hand():
    cfg = GSPOConfig(beta=0.1)
    assert (cfg.clip_low, cfg.clip_high) == (3e-4, 4e-4)
    a = 0.5 / 0.500001
    assert torch.allclose(GSPO.advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), cfg), torch.tensor([a, -a, -a, a]))
    # s_0 = exp(mean(0, ln1.5, ln0.5)) = 0.75^(1/3) ~ 0.909; s_1 = 0.75^(1/2) ~ 0.866.
    s0, s1 = 0.75 ** (1 / 3), 0.75 ** 0.5
    logp, x = _two_sequences()
    out, grad = _loss_and_grad(GSPO, x, cfg)
    # Seq 0, A=+1: -min(s0, clip(s0)) = -s0 (below 1 - 3e-4 but A > 0: the ratio branch).
    # Seq 1, A=-2: 2 * max(s1, 0.9997) = 1.9994, clipped low -> no gradient for any of its tokens.
    # KL: beta times the per-sequence MEAN of k3.
    assert out.loss_sum.item() == pytest.approx(-s0 + 1.9994 + 0.1 * (K3_SEQ0 / 3 + K3_SEQ1 / 2), abs=1e-12)
    assert out.denom == 2.0 and (out.stats["clip_low_frac"].total, out.stats["clip_high_frac"].total) == (1.0, 0.0)
    # d s_i / d logp_it = s_i / |o_i| for each token; KL grads 0.1 * (1 - e^d) / |o_i|.
    expected = torch.tensor([[-s0 / 3, -s0 / 3 - 0.1 / 3, -s0 / 3 + 0.05 / 3], [-0.1 / 2, 0.0, 0.0]], dtype=F64)
    assert torch.allclose(grad, expected, atol=1e-12)
    # Inverted ratios: s_0 = 0.75^(-1/3) > 1.0004 with A=+1 -> clipped high, loss -1.0004, no gradient;
    # s_1 = 0.75^(-1/2) with A=-2 -> 2 * s_1 (ratio branch), gradient 2 * s_1 / 2 per token.
    logp, x = _two_sequences(invert_ratio=True)
    out, grad = _loss_and_grad(GSPO, x, GSPOConfig())
    assert out.loss_sum.item() == pytest.approx(-1.0004 + 2 / s1, abs=1e-12)
    assert (out.stats["clip_low_frac"].total, out.stats["clip_high_frac"].total) == (0.0, 1.0)
    assert torch.allclose(grad, torch.tensor([[0.0, 0.0, 0.0], [1 / s1, 1 / s1, 0.0]], dtype=F64), atol=1e-12)


# ---- streaming invariance, for every registered algorithm --------------------------------------
def _batch(seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for index, rewards in enumerate([[1.0, 0.0, 0.5, 1.0], [0.0, 0.0, 1.0, 0.25], [0.3, 0.3, 0.3, 0.3]]):
        lengths = torch.randint(1, 7, (4,), generator=gen)
        if index == 1:
            lengths[1] = 0  # an empty response: contributes nothing but its share of the denominator
        logp = -torch.rand(4, 6, generator=gen, dtype=F64) * 3
        groups.append(dict(index=index, rewards=torch.tensor(rewards, dtype=F64), lengths=lengths, logp=logp,
                           old=logp + 0.3 * torch.randn(4, 6, generator=gen, dtype=F64),
                           ref=logp + 0.3 * torch.randn(4, 6, generator=gen, dtype=F64),
                           mask=torch.arange(6)[None, :] < lengths[:, None]))
    return groups


def _train(algo: Algorithm, cfg, groups, *, order, split, first_pass, streaming):
    """What the trainer does for one batch: returns (grad per group index / denom, loss / denom)."""
    scores, moments = {}, {}
    for g in (groups[i] for i in order):
        old = g["logp"] if first_pass else g["old"]
        r = algo.shape_rewards(g["rewards"], g["lengths"], cfg)
        if kl_in_reward(cfg):
            r = kl_penalised_rewards(rewards_N=r, logp_NT=old, ref_logp_NT=g["ref"], mask_NT=g["mask"], cfg=cfg)
        if algo.keeps_group(r, cfg):
            scores[g["index"]] = algo.advantages(r, cfg)
            moments[g["index"]] = score_moments(scores[g["index"]])
    batch = algo.advantage_scope == "batch"
    mu, c = batch_mean_scale(moments, eps=cfg.eps) if batch else (0.0, 1.0)
    two_pass = batch and streaming  # the exact path needs the batch statistics before the first group
    acc, loss, denom = {}, {}, 0.0
    for i in (i for i in order if i in scores):
        g = groups[i]
        leaf = g["logp"].clone().requires_grad_(True)
        adv_G = batch_normalise(scores[i], mu=mu, scale=c) if batch and not two_pass else scores[i]
        for rows in split:
            t = max(int(g["lengths"][rows].max()), 1)  # each micro-batch padded to its own longest
            old = leaf.detach() if first_pass else g["old"]
            passes = linear_passes(adv_G[rows], cfg) if two_pass else {"score": adv_G[rows]}
            for name, adv_N in passes.items():
                out = algo.loss(LossInputs(logp_NT=leaf[rows, :t], old_logp_NT=old[rows, :t],
                                           ref_logp_NT=g["ref"][rows, :t], adv_N=adv_N, mask_NT=g["mask"][rows, :t]),
                                cfg)
                grad = torch.autograd.grad(out.loss_sum, leaf, retain_graph=True)[0]
                acc.setdefault(name, {}).setdefault(i, torch.zeros_like(grad)).add_(grad)
                loss[name] = loss.get(name, 0.0) + out.loss_sum.item()
                denom += out.denom if name == "score" else 0.0
    if two_pass:
        total = {i: batch_normalise_at_barrier(at_score=acc["score"][i], at_one=acc["one"][i],
                                               at_zero=acc.get("zero", {}).get(i), mu=mu, scale=c) for i in scores}
        loss_total = batch_normalise_at_barrier(at_score=loss["score"], at_one=loss["one"], at_zero=loss.get("zero"),
                                                mu=mu, scale=c)
    else:
        total, loss_total = acc["score"], loss["score"]
    return torch.cat([total[i] / denom for i in sorted(total)]), loss_total / denom


_OVERRIDES = {"dapo": {"max_response_tokens": 6, "overlong_buffer": 3}, "dr_grpo": {"max_response_tokens": 6}}
# from the rewards alone (PPO's come per token from a critic: tests/test_critic.py)
_CASES = [(name, {}) for name in ALGORITHMS.names() if ALGORITHMS.get(name).advantages is not None] + [
    ("grpo", {"kl_in": "reward", "kl_estimator": "k1"}), ("reinforce_pp", {"baseline": True}),
    ("reinforce_pp", {"kl_in": "reward", "kl_estimator": "k2"}), ("dapo", {"dynamic_sampling": False}),
]


@pytest.mark.parametrize("first_pass", [True, False], ids=["ratio1", "ratio_ne_1"])
@pytest.mark.parametrize("name,extra", _CASES, ids=[f"{n}{'-' + '-'.join(e) if e else ''}" for n, e in _CASES])
def test_split_and_arrival_order_do_not_change_the_gradient(name, extra, first_pass):
    algo = ALGORITHMS.get(name)
    beta = {"beta": 0.05} if "beta" in algo.config_cls.model_fields else {}
    cfg = algo.config_cls(**{**beta, **_OVERRIDES.get(name, {}), **extra})
    groups = _batch(seed=1)
    # Reference: the whole batch known up front, one micro-batch per group, groups in index order.
    ref_grad, ref_loss = _train(algo, cfg, groups, order=[0, 1, 2], split=[[0, 1, 2, 3]], first_pass=first_pass,
                                streaming=False)
    assert ref_grad.abs().sum() > 0
    # Streaming: groups arrive in another order, split into uneven micro-batches (batch scope: two/three
    # linear passes combined at the barrier, which is exact only while ratio = 1).
    for order, split in [([2, 0, 1], [[2], [0, 3], [1]]), ([1, 2, 0], [[3, 1], [0, 2]])]:
        grad, loss = _train(algo, cfg, groups, order=order, split=split, first_pass=first_pass,
                            streaming=first_pass)
        assert torch.allclose(grad, ref_grad, atol=1e-6, rtol=0)
        assert loss == pytest.approx(ref_loss, abs=1e-6)


# ---- registry and contract ---------------------------------------------------------------------
def test_registry_lists_all_and_refuses_duplicates():
    assert ALGORITHMS.names() == ["dapo", "dr_grpo", "grpo", "gspo", "ppo", "reinforce_pp", "rloo"]
    for name in ALGORITHMS.names():
        algo = ALGORITHMS.get(name)
        assert algo.name == name
        with pytest.raises(ValueError, match="already registered"):
            ALGORITHMS.register(name, algo)
        with pytest.raises(ValueError):
            algo.config_cls(no_such_option=1)  # extra keys refused
    table = {n: (ALGORITHMS.get(n).normaliser, ALGORITHMS.get(n).advantage_scope) for n in ALGORITHMS.names()}
    assert table == {"dapo": ("tokens", "group"), "dr_grpo": ("constant", "group"), "grpo": ("sequences", "group"),
                     "gspo": ("sequences", "group"), "ppo": ("tokens", "batch"), "reinforce_pp": ("tokens", "batch"),
                     "rloo": ("sequences", "group")}


def test_algorithm_refuses_unknown_normaliser_and_scope():
    with pytest.raises(ValueError, match="normaliser"):
        Algorithm(name="x", config_cls=GRPOConfig, advantages=GRPO.advantages, loss=GRPO.loss, normaliser="rows")
    with pytest.raises(ValueError, match="advantage_scope"):
        Algorithm(name="x", config_cls=GRPOConfig, advantages=GRPO.advantages, loss=GRPO.loss, advantage_scope="all")
