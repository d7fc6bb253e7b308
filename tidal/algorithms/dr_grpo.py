"""Dr. GRPO: GRPO Done Right (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
Perspective", arXiv:2503.20783).

GRPO's 1/|o_i| favours long wrong answers and short right ones, and its 1/std(r) up-weights
prompts that are nearly all right or all wrong. Dr. GRPO removes both:
    A_i  = r_i - mean(r)                                 (no std scaling)
    pg_it = -min(ratio_it * A_i, clip(ratio_it, 1 - clip_low, 1 + clip_high) * A_i)
    J    = 1/(B * G * L) * sum_i sum_t (pg_it + beta * kl_it),   L = max_response_tokens
The normaliser is a constant, so no sample's weight depends on its length or on the others'.
The loss returns the plain token sum and denom = N * L per micro-batch (summed: B * G * L).
"""
from __future__ import annotations

import torch
from pydantic import Field

from tidal.algorithms.base import Algorithm, LossInputs, LossOutput
from tidal.algorithms.grpo import group_normalised
from tidal.algorithms.token_loss import ClipConfig, ResponseBudget, token_level_loss


class DrGRPOConfig(ResponseBudget, ClipConfig):
    max_response_tokens: int = Field(
        1024, ge=1,
        description="The constant length normaliser L; set it to the generator's max_new_tokens "
                    "(a larger value only scales the step size down; a shorter one is refused).",
    )


def dr_grpo_advantages(rewards_G: torch.Tensor, cfg: DrGRPOConfig) -> torch.Tensor:
    return group_normalised(rewards_G, scale_std=False, eps=1.0)  # eps unused without std scaling


def dr_grpo_loss(inputs: LossInputs, cfg: DrGRPOConfig) -> LossOutput:
    return token_level_loss(inputs, cfg, normaliser="constant", per_sequence_mean=False,
                            max_response_tokens=cfg.max_response_tokens)


DR_GRPO = Algorithm(name="dr_grpo", config_cls=DrGRPOConfig, advantages=dr_grpo_advantages,
                    loss=dr_grpo_loss, normaliser="constant")
