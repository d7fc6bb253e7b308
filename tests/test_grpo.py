"""GRPO advantages and loss against values worked out by hand in the comments."""
import math

import pytest
import torch

from tidal.algorithms.base import LossInputs
from tidal.algorithms.grpo import GRPO, GRPOConfig, grpo_advantages, grpo_loss
from tidal.algorithms.registry import ALGORITHMS, get_algorithm
from tidal.common.registry import Registry

torch.set_num_threads(1)
LN2, LN15, LN05 = math.log(2.0), math.log(1.5), math.log(0.5)


def test_advantages_by_hand():
    cfg = GRPOConfig()
    # mean 0.5, population std 0.5 -> +-0.5 / (0.5 + 1e-6)
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), cfg)
    a = 0.5 / 0.500001
    assert torch.allclose(adv, torch.tensor([a, -a, -a, a]), atol=0, rtol=1e-6)
    # mean 0.25, population std sqrt((0.75^2 + 3 * 0.25^2) / 4) = sqrt(0.1875)
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64), cfg)
    s = math.sqrt(0.1875) + 1e-6
    assert torch.allclose(adv, torch.tensor([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s], dtype=torch.float64))
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), GRPOConfig(scale_std=False))
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5]


@pytest.mark.parametrize("rewards", [[0.1, 0.1, 0.1], [1.0, 1.0], [0.0], [7.0]])
def test_advantages_constant_group_and_single_sample_are_zero(rewards):
    for scale_std in (True, False):
        adv = grpo_advantages(torch.tensor(rewards), GRPOConfig(scale_std=scale_std))
        assert adv.tolist() == [0.0] * len(rewards)


def test_advantages_refuse_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), GRPOConfig())
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 2), GRPOConfig())


def _two_sequences(pad: float = float("nan")):
    """Seq 0: A=+1, 3 tokens, ratios [1, 1.5, 0.5], ref - logp = [0, ln2, -ln2].
    Seq 1: A=-2, 2 tokens + 1 pad, ratios [0.5, 1.5], ref - logp = [ln2, 0]."""
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, pad]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, -1.0 - LN15, -1.0 - LN05], [-2.0 - LN05, -2.0 - LN15, pad]], dtype=torch.float64)
    ref = torch.tensor([[-1.0, -1.0 + LN2, -1.0 - LN2], [-2.0 + LN2, -2.0, pad]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    return logp, LossInputs(logp_NT=logp, old_logp_NT=old, ref_logp_NT=ref, adv_N=adv, mask_NT=mask)


def test_loss_by_hand_with_clipping_on_both_sides_and_kl():
    logp, inputs = _two_sequences()
    out = grpo_loss(inputs, GRPOConfig(clip_low=0.2, clip_high=0.2, beta=0.1))
    # Seq 0 (A=+1): -min(1, 1) = -1; -min(1.5, 1.2) = -1.2 (high clip); -min(0.5, 0.8) = -0.5.
    #   mean = -2.7 / 3 = -0.9
    # Seq 1 (A=-2): -min(-1, -1.6) = 1.6 (low clip); -min(-3, -2.4) = 3.  mean = 4.6 / 2 = 2.3
    pg = -0.9 + 2.3
    # k3(d) = e^d - d - 1: k3(0) = 0, k3(ln2) = 1 - ln2, k3(-ln2) = ln2 - 0.5
    kl0 = (0.0 + (1 - LN2) + (LN2 - 0.5)) / 3  # = 1/6
    kl1 = ((1 - LN2) + 0.0) / 2
    assert out.loss_sum.item() == pytest.approx(pg + 0.1 * (kl0 + kl1), abs=1e-12)
    assert out.denom == 2.0
    assert out.stats["kl"].total == pytest.approx(1 / 6 + (1 - LN2) / 2, abs=1e-12)
    assert out.stats["clip_high_frac"].total == pytest.approx(1 / 3)
    assert out.stats["clip_low_frac"].total == pytest.approx(1 / 2)
    assert out.stats["clip_frac"].total == pytest.approx(1 / 3 + 1 / 2)

    out.loss_sum.backward()
    # d/dlogp of -ratio*A is -ratio*A (0 where the clamp is active); of k3 it is 1 - e^d.
    # Each term is divided by its sequence's length (3 and 2); the pad gets exactly 0.
    expected = torch.tensor([
        [-1.0 / 3 + 0.1 * 0.0 / 3, 0.0 + 0.1 * (1 - 2.0) / 3, -0.5 / 3 + 0.1 * (1 - 0.5) / 3],
        [0.0 + 0.1 * (1 - 2.0) / 2, 2.0 * 1.5 / 2 + 0.0, 0.0],
    ], dtype=torch.float64)
    assert torch.allclose(logp.grad, expected, atol=1e-12)


def test_gradient_simple_case_and_beta_zero_ignores_ref():
    # One sequence, ratio 1, A=2, 3 tokens: loss = -(2 + 2 + 2) / 3 = -2, dloss/dlogp_t = -2 / 3.
    logp = torch.tensor([[-0.5, -1.5, -2.5]], requires_grad=True)
    inputs = LossInputs(logp_NT=logp, old_logp_NT=logp.detach(), ref_logp_NT=None,
                        adv_N=torch.tensor([2.0]), mask_NT=torch.ones(1, 3, dtype=torch.bool))
    out = grpo_loss(inputs, GRPOConfig())
    out.loss_sum.backward()
    assert out.loss_sum.item() == pytest.approx(-2.0)
    assert torch.allclose(logp.grad, torch.full((1, 3), -2.0 / 3))
    assert out.stats["kl"].total == 0.0


def test_empty_sequence_gives_no_nan():
    # Seq 0 has no response token; padding holds -inf/NaN, as garbage from a real forward might.
    mask = torch.tensor([[False, False, False], [True, False, False]])
    logp = torch.where(mask, -1.0, float("-inf")).requires_grad_(True)
    pad_nan = torch.where(mask, -1.0, float("nan"))
    inputs = LossInputs(logp_NT=logp, old_logp_NT=pad_nan, ref_logp_NT=pad_nan,
                        adv_N=torch.tensor([1.0, -1.0]), mask_NT=mask)
    out = grpo_loss(inputs, GRPOConfig(beta=0.1))
    out.loss_sum.backward()
    assert out.loss_sum.item() == pytest.approx(1.0)  # only seq 1: -(1 * -1) / 1, k3(0) = 0
    assert out.denom == 2.0  # the empty sequence still counts towards 1/(B*G)
    assert torch.isfinite(logp.grad).all()
    assert all(math.isfinite(fig.value()) for fig in out.stats.values())


def test_micro_batch_split_invariance():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([6, 2, 4, 1])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    adv = torch.tensor([1.0, -0.5, 0.25, -2.0], dtype=torch.float64)
    cfg = GRPOConfig(clip_low=0.1, clip_high=0.3, beta=0.05)

    def run(parts):
        leaf = logp.clone().requires_grad_(True)
        total = 0.0
        for rows, t in parts:  # each micro-batch is padded only to its own longest sequence
            out = grpo_loss(LossInputs(logp_NT=leaf[rows, :t], old_logp_NT=old[rows, :t], ref_logp_NT=ref[rows, :t],
                                       adv_N=adv[rows], mask_NT=mask[rows, :t]), cfg)
            total = total + out.loss_sum
        total.backward()
        return total.item(), leaf.grad

    whole_loss, whole_grad = run([(slice(0, 4), 6)])
    split_loss, split_grad = run([(slice(0, 2), 6), (slice(2, 4), 4)])
    assert split_loss == pytest.approx(whole_loss, abs=1e-6)
    assert torch.allclose(split_grad, whole_grad, atol=1e-6)


def test_loss_refuses_bad_input():
    logp, inputs = _two_sequences()
    with pytest.raises(ValueError, match="ref_logp_NT"):
        grpo_loss(LossInputs(logp_NT=logp, old_logp_NT=inputs.old_logp_NT, ref_logp_NT=None,
                             adv_N=inputs.adv_N, mask_NT=inputs.mask_NT), GRPOConfig(beta=0.1))
    with pytest.raises(ValueError, match="adv_N"):
        grpo_loss(LossInputs(logp_NT=logp, old_logp_NT=inputs.old_logp_NT, ref_logp_NT=None,
                             adv_N=torch.zeros(3), mask_NT=inputs.mask_NT), GRPOConfig())


def test_config_validation():
    with pytest.raises(ValueError):
        GRPOConfig(clip_lo=0.1)  # typo -> refused, not silently ignored
    with pytest.raises(ValueError):
        GRPOConfig(beta=-1.0)


def test_registry():
    assert get_algorithm("grpo") is GRPO
    assert "grpo" in ALGORITHMS.names()  # the full list is frozen in test_algorithms.py
    with pytest.raises(ValueError, match="already registered"):
        ALGORITHMS.register("grpo", GRPO)
    with pytest.raises(ValueError) as e:
        get_algorithm("foo")
    assert str(e.value) == "unknown algo 'foo'; known: dapo, dr_grpo, grpo, gspo, ppo, reinforce_pp, rloo"
    reg = Registry("thing")
    reg.register("b", 2)
    reg.register("a", 1)
    with pytest.raises(ValueError) as e:
        reg.get("c")
    assert str(e.value) == "unknown thing 'c'; known: a, b"
