"""REINFORCE++ (Hu et al. 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with
Global Normalization", arXiv:2501.03262; earlier versions: "A Simple and Efficient Approach ...").

No critic and no per-prompt normalisation: the score of each sample is normalised over the
whole global batch, which the paper argues is less biased than a per-group std:
    s_i = r_i                           (REINFORCE++)
    s_i = r_i - mean(r of its group)    (REINFORCE++ w/ baseline, `baseline=True`, for G > 1)
    A_i = (s_i - mean_batch(s)) / (std_batch(s) + eps)
The loss is the PPO clipped surrogate per token, summed over tokens and divided by the batch's
token count (denom = tokens). The paper puts the KL into the reward (its return-to-go at the first
token is r - beta * sum_t kl_t, the per-sequence penalty of kl_in="reward"); here, too, it is an
option. Batch statistics exist only at the barrier; tidal/algorithms/batch_scope.py makes streaming
exact anyway, so `reinforce_pp_scores` returns s, not A.
"""
from __future__ import annotations

import torch
from pydantic import Field

from tidal.algorithms.base import Algorithm, LossInputs, LossOutput, check_rewards, upcast
from tidal.algorithms.grpo import group_normalised
from tidal.algorithms.token_loss import ClipConfig, token_level_loss


class ReinforcePPConfig(ClipConfig):
    baseline: bool = Field(
        False, description="Subtract each group's mean reward before the batch normalisation (w/ baseline variant).",
    )
    eps: float = Field(1e-6, gt=0.0, description="Added to the batch std before dividing.")

    @property
    def group_relative(self) -> bool:
        return self.baseline  # without the group baseline the scores are normalised over the batch


def reinforce_pp_scores(rewards_G: torch.Tensor, cfg: ReinforcePPConfig) -> torch.Tensor:
    if cfg.baseline:
        return group_normalised(rewards_G, scale_std=False, eps=cfg.eps)
    check_rewards(rewards_G)
    return upcast(rewards_G)


def reinforce_pp_loss(inputs: LossInputs, cfg: ReinforcePPConfig) -> LossOutput:
    return token_level_loss(inputs, cfg, normaliser="tokens", per_sequence_mean=False)


REINFORCE_PP = Algorithm(name="reinforce_pp", config_cls=ReinforcePPConfig, advantages=reinforce_pp_scores,
                         loss=reinforce_pp_loss, normaliser="tokens", advantage_scope="batch")
