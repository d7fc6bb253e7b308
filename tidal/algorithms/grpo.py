"""GRPO: Group Relative Policy Optimization (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300).

For a prompt q the generator samples a group of G responses o_1..o_G with rewards r_1..r_G.

Advantage (outcome supervision, the same value for every token of o_i):
    A_i = (r_i - mean(r)) / (std(r) + eps)        (or r_i - mean(r) with scale_std=False)

Per token t of o_i, with ratio_it = exp(logp_it - old_logp_it):
    pg_it = -min(ratio_it * A_i, clip(ratio_it, 1 - clip_low, 1 + clip_high) * A_i)
    k3_it = exp(ref_logp_it - logp_it) - (ref_logp_it - logp_it) - 1     (unbiased, always >= 0)
    l_it  = pg_it + beta * k3_it          (kl_estimator / kl_in choose another estimator or place)

Objective: J = 1/G * sum_i 1/|o_i| * sum_t l_it, averaged over the B prompts of the batch.
`grpo_loss` returns only sum_i (1/|o_i| * sum_t l_it) over its micro-batch and denom = N; the
trainer divides the accumulated sum by B*G once, at the barrier, so a sequence's loss never
depends on which micro-batch it landed in.
"""
from __future__ import annotations

import torch
from pydantic import Field

from tidal.algorithms.base import Algorithm, LossInputs, LossOutput, check_rewards, upcast
from tidal.algorithms.token_loss import ClipConfig, token_level_loss


class GRPOConfig(ClipConfig):
    scale_std: bool = Field(
        True, description="Divide group-centred rewards by the group std; False keeps r - mean (Dr. GRPO)."
    )
    eps: float = Field(
        1e-6, gt=0.0, description="Added to the group std before dividing, so near-constant groups stay finite."
    )


def group_normalised(rewards_G: torch.Tensor, *, scale_std: bool, eps: float) -> torch.Tensor:
    """(r - mean) / (std + eps), or r - mean; exactly zero for a group with one reward value.

    The std is the POPULATION std (divide by G, unbiased=False): it describes the group as it is,
    is defined for G=1 (0, not NaN), and matches the normalisation a user gets by z-scoring the
    group by hand. A group whose rewards are all equal carries no signal: its advantages are
    exactly zero (checked explicitly, because r - mean can leave float dust like 1e-17).
    """
    check_rewards(rewards_G)
    r_G = upcast(rewards_G)
    if bool((r_G == r_G[0]).all()):
        return torch.zeros_like(r_G)
    centred_G = r_G - r_G.mean()
    if not scale_std:
        return centred_G
    return centred_G / (r_G.std(unbiased=False) + eps)


def grpo_advantages(rewards_G: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    return group_normalised(rewards_G, scale_std=cfg.scale_std, eps=cfg.eps)


def grpo_loss(inputs: LossInputs, cfg: GRPOConfig) -> LossOutput:
    """Clipped surrogate + beta * KL; per-sequence token mean, summed over sequences."""
    return token_level_loss(inputs, cfg, normaliser="sequences", per_sequence_mean=True)


GRPO = Algorithm(name="grpo", config_cls=GRPOConfig, advantages=grpo_advantages, loss=grpo_loss)
