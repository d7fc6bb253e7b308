"""GAE, token rewards and the clipped value loss against hand computations (tidal/algorithms/gae.py)."""
from __future__ import annotations

import math

import pytest
import torch

from tidal.algorithms.gae import clipped_value_loss, explained_variance, gae, token_rewards

# two responses of uneven length: 3 tokens and 1 token, padded to T = 3
MASK = torch.tensor([[True, True, True], [True, False, False]])
VALUES = torch.tensor([[0.5, 0.25, -0.5], [0.125, 9.0, 9.0]])  # the padding's 9s must not leak in
REWARDS = torch.tensor([1.0, -2.0])


def test_token_rewards_sit_on_the_last_token_and_take_the_kl():
    r = token_rewards(REWARDS, MASK)
    assert r.tolist() == [[0, 0, 1], [-2, 0, 0]]
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 5.0, 5.0]])
    r = token_rewards(REWARDS, MASK, kl_NT=kl, beta=0.5)
    torch.testing.assert_close(r, torch.tensor([[-0.05, -0.1, 0.85], [-2.2, 0, 0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="no tokens"):
        token_rewards(REWARDS, torch.tensor([[True], [False]]))


def test_gae_by_hand():
    gamma, lam = 0.9, 0.8
    r = token_rewards(REWARDS, MASK)
    adv, ret = gae(r, VALUES, MASK, gamma=gamma, lam=lam)
    # sequence 0, backwards: delta_2 = 1 - (-0.5) = 1.5; delta_1 = 0 + 0.9*(-0.5) - 0.25 = -0.7;
    # delta_0 = 0 + 0.9*0.25 - 0.5 = -0.275
    a2 = 1.5
    a1 = -0.7 + gamma * lam * a2
    a0 = -0.275 + gamma * lam * a1
    # sequence 1: one token, delta_0 = -2 - 0.125
    expect = torch.tensor([[a0, a1, a2], [-2.125, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expect)
    torch.testing.assert_close(ret, (expect + VALUES.double()) * MASK)


def test_gamma_lam_one_is_monte_carlo_and_lam_zero_is_td():
    r = token_rewards(REWARDS, MASK, kl_NT=torch.full((2, 3), 0.1), beta=1.0)
    _, ret = gae(r, VALUES, MASK, gamma=1.0, lam=1.0)
    mc = torch.flip(torch.cumsum(torch.flip(r, [1]), 1), [1]) * MASK  # sum of the rewards from t on
    torch.testing.assert_close(ret, mc)
    adv, _ = gae(r, VALUES, MASK, gamma=0.95, lam=0.0)
    v = VALUES.double() * MASK
    next_v = torch.cat([v[:, 1:], torch.zeros(2, 1, dtype=torch.float64)], 1)
    torch.testing.assert_close(adv, (r + 0.95 * next_v - v) * MASK)


def test_clipped_value_loss_by_hand():
    mask = torch.tensor([[True, True, False]])
    old = torch.tensor([[0.0, 1.0, 0.0]])
    ret = torch.tensor([[1.0, 0.0, 7.0]])
    new = torch.tensor([[0.5, 1.5, 3.0]], requires_grad=True)
    loss, clipped = clipped_value_loss(new, old, ret, mask, clip=0.2)
    # token 0: plain (0.5-1)^2 = 0.25, clipped (0.2-1)^2 = 0.64 -> 0.64 (the clip wins)
    # token 1: plain (1.5-0)^2 = 2.25, clipped (1.2-0)^2 = 1.44 -> 2.25; token 2 is padding
    assert loss.item() == pytest.approx(0.5 * (0.64 + 2.25)) and clipped == 1
    loss.backward()
    # the winning branch's gradient: token 0 is clipped (no gradient), token 1 is (V - R) = 1.5
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 1.5, 0.0]]))


def test_value_clipfrac_counts_only_tokens_the_clamp_moved():
    # V - V_old = -0.09 is inside the band (clip 0.2): V_old + (V - V_old) rounds to a float just off V,
    # and that branch's square is larger than the plain one by the rounding alone; no clip acted
    v, old, mask = torch.tensor([[-0.07]]), torch.tensor([[0.02]]), torch.tensor([[True]])
    assert ((old + (v - old).clamp(-0.2, 0.2)) - 0.0) ** 2 > (v - 0.0) ** 2  # the rounding the count must ignore
    _, clipped = clipped_value_loss(v, old, torch.tensor([[0.0]]), mask, clip=0.2)
    assert clipped == 0
    # just outside the band, with the clipped branch winning: counted
    _, clipped = clipped_value_loss(torch.tensor([[-0.19]]), old, torch.tensor([[-1.0]]), mask, clip=0.2)
    assert clipped == 1


def test_explained_variance():
    ret = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    assert explained_variance(ret, ret, MASK) == 1.0
    mean = torch.full_like(ret, 2.5)
    assert explained_variance(mean, ret, MASK) == pytest.approx(0.0)
    assert math.isnan(explained_variance(ret, torch.ones_like(ret), MASK))  # constant returns: undefined


def test_per_token_advantages_in_the_clipped_loss():
    """adv_NT reaches the PPO-clip token loss: equal to adv_N when constant along each row, and each
    token's gradient is -A_t * ratio_t / |o_i| (sequence-mean normaliser) where the clip is not active."""
    from tidal.algorithms.base import LossInputs
    from tidal.algorithms.registry import get_algorithm

    grpo = get_algorithm("grpo")
    cfg = grpo.config_cls()
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() + torch.tensor([[0.05, -0.05, 0.0], [0.1, 0.0, 0.0]], dtype=torch.float64)
    adv_N = torch.tensor([0.7, -1.2], dtype=torch.float64)
    per_sample = grpo.loss(LossInputs(logp_NT=logp, old_logp_NT=old, ref_logp_NT=None, mask_NT=MASK, adv_N=adv_N), cfg)
    per_token = grpo.loss(LossInputs(logp_NT=logp, old_logp_NT=old, ref_logp_NT=None, mask_NT=MASK,
                                     adv_NT=adv_N[:, None].expand(2, 3).clone()), cfg)
    torch.testing.assert_close(per_token.loss_sum, per_sample.loss_sum)
    adv_NT = torch.tensor([[0.5, -1.0, 2.0], [-0.25, 9.0, 9.0]], dtype=torch.float64)
    out = grpo.loss(LossInputs(logp_NT=logp, old_logp_NT=old, ref_logp_NT=None, mask_NT=MASK, adv_NT=adv_NT), cfg)
    (grad,) = torch.autograd.grad(out.loss_sum, logp)
    ratio = torch.exp(logp.detach() - old) * MASK
    torch.testing.assert_close(grad, -adv_NT * ratio * MASK / MASK.sum(1, keepdim=True))  # ratios within the clip
    with pytest.raises(ValueError, match="exactly one"):
        grpo.loss(LossInputs(logp_NT=logp, old_logp_NT=old, ref_logp_NT=None, mask_NT=MASK), cfg)
    with pytest.raises(ValueError, match="adv_NT has shape"):
        grpo.loss(LossInputs(logp_NT=logp, old_logp_NT=old, ref_logp_NT=None, mask_NT=MASK, adv_NT=adv_NT[:, :2]), cfg)
    with pytest.raises(ValueError, match="per sequence"):
        get_algorithm("gspo").loss(LossInputs(logp_NT=logp, old_logp_NT=old, ref_logp_NT=None, mask_NT=MASK,
                                              adv_NT=adv_NT), get_algorithm("gspo").config_cls())
