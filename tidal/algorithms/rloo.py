"""RLOO: REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE
Style Optimization for Learning from Human Feedback in LLMs", arXiv:2402.14740).

Each sample's baseline is the mean reward of the OTHER G - 1 samples of its prompt, which keeps
the estimator unbiased (the baseline does not depend on the sample itself):
    A_i = r_i - 1/(G-1) * sum_{j != i} r_j  =  G/(G-1) * (r_i - mean(r))
The paper's estimator is REINFORCE on the whole response, -A_i * log pi(o_i) = -A_i * sum_t logp_it:
a token SUM per sequence, averaged over the B*G sequences (denom = N per micro-batch). The ratio
form -min(ratio * A, clip(ratio) * A) has exactly that gradient while ratio = 1 (one optimizer step
per batch); with several steps per batch it becomes the clipped importance-weighted version.
"""
from __future__ import annotations

import torch

from tidal.algorithms.base import Algorithm, LossInputs, LossOutput, check_rewards, upcast
from tidal.algorithms.token_loss import ClipConfig, token_level_loss


class RLOOConfig(ClipConfig):
    """Clip 0.2 / 0.2 and no KL by default; the paper put the KL into the reward (kl_in="reward")."""


def rloo_advantages(rewards_G: torch.Tensor, cfg: RLOOConfig) -> torch.Tensor:
    check_rewards(rewards_G)
    g = rewards_G.numel()
    if g < 2:
        raise ValueError(f"rloo needs at least 2 samples per prompt for a leave-one-out baseline, got {g}")
    r_G = upcast(rewards_G)
    if bool((r_G == r_G[0]).all()):
        return torch.zeros_like(r_G)  # exact zeros, not float dust
    return r_G - (r_G.sum() - r_G) / (g - 1)


def rloo_loss(inputs: LossInputs, cfg: RLOOConfig) -> LossOutput:
    return token_level_loss(inputs, cfg, normaliser="sequences", per_sequence_mean=False)


RLOO = Algorithm(name="rloo", config_cls=RLOOConfig, advantages=rloo_advantages, loss=rloo_loss)
