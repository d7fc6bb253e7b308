"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al. 2025, arXiv:2503.14476).

GRPO's group advantages, with four changes:
  clip-higher:   clip(ratio, 1 - clip_low, 1 + clip_high) with clip_high > clip_low (0.2 / 0.28),
                 so low-probability tokens can still grow (keeps entropy up).
  token-level:   J = 1/sum_i |o_i| * sum_i sum_t pg_it over the whole batch, so every token weighs
                 the same whatever the length of its response; the loss returns the token sum and
                 denom = its token count, and the trainer divides once at the barrier.
  overlong:      with L = max_response_tokens and C = overlong_buffer, a reward term
                     0                      if |o| <= L - C
                     ((L - C) - |o|) / C    if L - C < |o| <= L     (linear from 0 down to -1)
                     -1                     if |o| > L
                 times overlong_factor, added to the reward before advantages.
  dynamic sampling: a group whose rewards are all equal has zero advantages and no gradient;
                 it is dropped and the batch is topped up with further prompts.
No KL term by default (beta = 0).
"""
from __future__ import annotations

import torch
from pydantic import Field, model_validator

from tidal.algorithms.base import Algorithm, LossInputs, LossOutput, check_rewards, upcast
from tidal.algorithms.grpo import group_normalised
from tidal.algorithms.token_loss import ClipConfig, ResponseBudget, token_level_loss


class DAPOConfig(ResponseBudget, ClipConfig):
    clip_high: float = Field(0.28, ge=0.0, description="Upper clip 1 + clip_high; DAPO's clip-higher (0.28 > 0.2).")
    eps: float = Field(1e-6, gt=0.0, description="Added to the group std before dividing.")
    max_response_tokens: int = Field(
        1024, ge=1, description="L of the overlong penalty; set it to the generator's max_new_tokens.",
    )
    overlong_buffer: int = Field(
        0, ge=0,
        description="C: responses longer than L - C are penalised linearly, down to -1 at L; 0 = off "
                    "(DAPO used 4096 of 20480 tokens).",
    )
    overlong_factor: float = Field(1.0, ge=0.0, description="Scale of the overlong penalty.")
    dynamic_sampling: bool = Field(
        True, description="Drop groups whose rewards are all equal (no signal); the batch is topped up.",
    )

    @property
    def filters_groups(self) -> bool:
        return self.dynamic_sampling

    @model_validator(mode="after")
    def _buffer_fits(self) -> "DAPOConfig":
        if self.overlong_buffer > self.max_response_tokens:
            raise ValueError(f"overlong_buffer={self.overlong_buffer} exceeds max_response_tokens="
                             f"{self.max_response_tokens}")
        return self


def overlong_penalty(lengths_N: torch.Tensor, *, max_tokens: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment per response (<= 0, float64); buffer 0 turns it off."""
    if buffer < 0 or buffer > max_tokens:
        raise ValueError(f"buffer must be in [0, max_tokens={max_tokens}], got {buffer}")
    len_N = lengths_N.to(torch.float64)
    if buffer == 0:
        return torch.zeros_like(len_N)
    soft_start = max_tokens - buffer
    ramp_N = (soft_start - len_N) / buffer
    pen_N = torch.where(len_N <= soft_start, 0.0, torch.where(len_N <= max_tokens, ramp_N, -1.0))
    return factor * pen_N


def keeps_group(rewards_G: torch.Tensor) -> bool:
    """Dynamic sampling: keep a group only if its rewards differ (else all advantages are 0)."""
    check_rewards(rewards_G)
    return bool((rewards_G != rewards_G[0]).any())


def dapo_keeps_group(rewards_G: torch.Tensor, cfg: DAPOConfig) -> bool:
    return keeps_group(rewards_G) or not cfg.dynamic_sampling


def dapo_shape_rewards(rewards_G: torch.Tensor, lengths_G: torch.Tensor, cfg: DAPOConfig) -> torch.Tensor:
    longest = int(lengths_G.max().item())
    if longest > cfg.max_response_tokens:
        # The generator's cap is larger than the configured L: every long answer would get -1.
        raise ValueError(f"a response has {longest} tokens, more than max_response_tokens="
                         f"{cfg.max_response_tokens}; set it to the generator's max_new_tokens")
    r_G = upcast(rewards_G)
    pen_G = overlong_penalty(lengths_G, max_tokens=cfg.max_response_tokens, buffer=cfg.overlong_buffer,
                             factor=cfg.overlong_factor)
    return r_G + pen_G.to(r_G.dtype)


def dapo_advantages(rewards_G: torch.Tensor, cfg: DAPOConfig) -> torch.Tensor:
    return group_normalised(rewards_G, scale_std=True, eps=cfg.eps)


def dapo_loss(inputs: LossInputs, cfg: DAPOConfig) -> LossOutput:
    return token_level_loss(inputs, cfg, normaliser="tokens", per_sequence_mean=False)


DAPO = Algorithm(name="dapo", config_cls=DAPOConfig, advantages=dapo_advantages, loss=dapo_loss,
                 normaliser="tokens", shape_rewards=dapo_shape_rewards, keeps_group=dapo_keeps_group)
