"""The token loss's registered terms (tidal/algorithms/surrogates.py, penalties.py) against values computed by
hand: CISPO, a surrogate and a penalty of one's own (tests/objective_plugin.py, named in the config), the
built-in KL and entropy bonus through the registry, and the configs refused."""
from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from tidal.algorithms.base import LossInputs
from tidal.algorithms.grpo import GRPOConfig
from tidal.algorithms.gspo import GSPOConfig
from tidal.algorithms.token_loss import token_level_loss

MASK = torch.tensor([[True, True, True], [True, True, False]])
ADV = torch.tensor([1.0, -2.0])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], dtype=torch.float64)
# pi / pi_old per token: [1, 2, 0.5] and [1.5, 0.5] (the third is padding)
RATIO = torch.tensor([[1.0, 2.0, 0.5], [1.5, 0.5, 7.0]], dtype=torch.float64)
PLUGIN = "tests.objective_plugin"


def _loss(*, ref=None, entropy=None, **cfg):
    """A token-sum loss (tokens normaliser) at pi = pi_old * RATIO, and d loss / d logp."""
    logp = (OLD + RATIO.log()).requires_grad_(True)
    inputs = LossInputs(logp_NT=logp, old_logp_NT=OLD, ref_logp_NT=ref, mask_NT=MASK, adv_N=ADV, entropy_NT=entropy)
    out = token_level_loss(inputs, GRPOConfig(**cfg), normaliser="tokens", per_sequence_mean=False)
    out.loss_sum.backward()
    return out, logp.grad


def test_cispo_weights_reinforce_by_the_clipped_ratio_and_keeps_every_gradient():
    # clip to [0.8, 1.6]: weights [1, 1.6, 0.8] and [1.5, 0.8]; value -w * A, gradient -w * A on every token
    out, grad = _loss(surrogate="cispo", clip_low=0.2, clip_high=0.6)
    assert out.loss_sum.item() == pytest.approx(-(1 + 1.6 + 0.8) + 2 * (1.5 + 0.8))
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -1.6, -0.8], [3.0, 1.6, 0.0]], dtype=torch.float64))
    assert out.stats["clip_low_frac"].total == 2 and out.stats["clip_high_frac"].total == 1  # 0.5, 0.5 and 2
    # the clipped surrogate at the same ratios: the clamp's branch takes the gradient away (2 with A > 0, 0.5 with A < 0)
    clip, grad = _loss(clip_low=0.2, clip_high=0.6)
    assert clip.loss_sum.item() == pytest.approx(-(1 + 1.6 + 0.5) + 2 * (1.5 + 0.8))
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.0, -0.5], [3.0, 0.0, 0.0]], dtype=torch.float64))


def test_a_surrogate_of_ones_own_is_one_file_named_in_the_config():
    out, grad = _loss(surrogate=f"{PLUGIN}:UNCLIPPED")  # -r * A, nothing clipped
    assert out.loss_sum.item() == pytest.approx(-(1 + 2 + 0.5) + 2 * (1.5 + 0.5))
    torch.testing.assert_close(grad, -RATIO * torch.tensor([[1.0], [-2.0]], dtype=torch.float64) * MASK)
    assert out.stats["clip_frac"].total == 0


def test_a_penalty_of_ones_own_is_added_to_every_kept_token_and_reports_its_figure():
    """OLD_K2 = c * (log r)^2 / 2 per token, beside the surrogate: the loss and gradient move by exactly it."""
    plain, plain_grad = _loss()
    out, grad = _loss(penalties={f"{PLUGIN}:OLD_K2": 0.5})
    log_r = RATIO.log() * MASK
    assert out.loss_sum.item() == pytest.approx(plain.loss_sum.item() + 0.5 * 0.5 * (log_r ** 2).sum().item())
    torch.testing.assert_close(grad, plain_grad + 0.5 * log_r)
    assert out.stats["old_k2"].total == pytest.approx(0.5 * (log_r ** 2).sum().item()) and out.stats["old_k2"].over == 5
    assert "old_k2" not in plain.stats


def test_the_built_in_penalties_go_through_the_registry_in_their_order():
    """beta * k3 and -c * H per token, added after the surrogate (a KL of 0 where pi = ref, so k3 at ref = pi_old)."""
    entropy = torch.tensor([[0.3, 0.2, 0.1], [0.4, 0.5, 9.0]], dtype=torch.float64, requires_grad=True)
    plain, _ = _loss()
    out, grad = _loss(ref=OLD, entropy=entropy, beta=0.1, entropy_coef=0.01)
    d = -RATIO.log()  # ref - logp
    k3 = ((d.exp() - d - 1) * MASK).sum().item()
    assert out.loss_sum.item() == pytest.approx(plain.loss_sum.item() + 0.1 * k3 - 0.01 * 1.5)
    assert out.stats["kl"].total == pytest.approx(k3) and entropy.grad[0, 0] == -0.01 and entropy.grad[1, 2] == 0
    with pytest.raises(ValueError, match="entropy_coef > 0 needs the policy's token entropy"):
        _loss(entropy_coef=0.01)


def test_what_a_config_of_terms_needs_and_refuses():
    assert GRPOConfig(penalties={f"{PLUGIN}:OLD_K2": 1.0}).needs_reference is False  # it reads pi_old only
    assert GRPOConfig(entropy_coef=0.1).needs_entropy and not GRPOConfig().needs_entropy
    cases = [({"surrogate": "nope"}, "algorithm.surrogate: unknown surrogate 'nope'; known: cispo, clip"),
             ({"surrogate": f"{PLUGIN}:OLD_K2"}, "is of type Penalty, where an object of type Surrogate is needed"),
             ({"penalties": {"kl": 0.1}}, "algorithm.penalties: 'kl' is built in; set algorithm.beta"),
             ({"penalties": {"entropy": 0.1}}, "set algorithm.entropy_coef"),
             ({"penalties": {f"{PLUGIN}:NOPE": 0.1}}, "module 'tests.objective_plugin' has no attribute 'NOPE'"),
             ({"surrogate": "cispo", "correction": {"kind": "aipo"}}, "that correction replaces the surrogate")]
    for cfg, message in cases:
        with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
            GRPOConfig(**cfg)
    for cfg in ({"surrogate": "cispo"}, {"penalties": {f"{PLUGIN}:OLD_K2": 1.0}}):
        with pytest.raises(ValidationError, match=f"{next(iter(cfg))}: gspo's ratio is per sequence"):
            GSPOConfig(**cfg)


def test_a_penalty_is_summed_as_the_loss_is_per_sequence():
    """GRPO's per-sequence mean weighs a token 1/|o_i|: the penalty too, and its figure is per sequence."""
    logp = (OLD + RATIO.log()).requires_grad_(True)
    inputs = LossInputs(logp_NT=logp, old_logp_NT=OLD, ref_logp_NT=None, mask_NT=MASK, adv_N=torch.zeros(2))
    out = token_level_loss(inputs, GRPOConfig(penalties={f"{PLUGIN}:OLD_K2": 1.0}), normaliser="sequences",
                           per_sequence_mean=True)
    k2 = 0.5 * (RATIO.log() * MASK) ** 2
    per_seq = k2[0].sum() / 3 + k2[1].sum() / 2
    assert out.loss_sum.item() == pytest.approx(per_seq.item()) and out.stats["old_k2"].over == 2
    assert out.stats["old_k2"].value() == pytest.approx(per_seq.item() / 2)
