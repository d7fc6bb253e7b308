"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071).

GRPO's group advantages, but the importance ratio and its clipping live at the level of the
sequence, matching the sequence-level reward:
    s_i   = exp(1/|o_i| * sum_t (logp_it - old_logp_it))     (length-normalised sequence ratio)
    l_i   = -min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i) + beta * mean_t kl_it
    J     = 1/(B*G) * sum_i l_i                       (denom = N sequences per micro-batch)
Because s_i is a geometric mean its spread is small, hence the tiny clip ranges (3e-4 / 4e-4 in
the paper). A clipped sequence gets no policy-gradient at all, for any of its tokens.
"""
from __future__ import annotations

import torch
from pydantic import Field, model_validator

from tidal.algorithms.base import Algorithm, LossInputs, LossOutput, check_loss_inputs, upcast
from tidal.algorithms.corrections import correction_figures, log_ratio
from tidal.algorithms.figures import Largest, Mean
from tidal.algorithms.grpo import group_normalised
from tidal.algorithms.kl import check_kl_inputs, kl_in_loss, masked_kl_NT
from tidal.algorithms.surrogates import clipped_surrogate
from tidal.algorithms.token_loss import ClipConfig


class GSPOConfig(ClipConfig):
    clip_low: float = Field(3e-4, ge=0.0, lt=1.0, description="Sequence ratio clamped below at 1 - clip_low.")
    clip_high: float = Field(4e-4, ge=0.0, description="Sequence ratio clamped above at 1 + clip_high.")
    eps: float = Field(1e-6, gt=0.0, description="Added to the group std before dividing.")

    @model_validator(mode="after")
    def _token_options(self) -> "GSPOConfig":
        # its ratio and clip are per sequence: the token-level corrections have nothing to act on
        for name, off in (("correction", not self.correction.needs_behaviour), ("clip_ratio_c", self.clip_ratio_c is None),
                          ("log_ratio_clamp", self.log_ratio_clamp is None), ("entropy_coef", self.entropy_coef == 0),
                          ("surrogate", self.surrogate == "clip"), ("penalties", not self.penalties)):
            if not off:
                raise ValueError(f"{name}: gspo's ratio is per sequence; it applies to the "
                                 f"token-level losses (grpo, dr_grpo, dapo, rloo, reinforce_pp, ppo)")
        return self


def gspo_advantages(rewards_G: torch.Tensor, cfg: GSPOConfig) -> torch.Tensor:
    return group_normalised(rewards_G, scale_std=True, eps=cfg.eps)


def gspo_loss(inputs: LossInputs, cfg: GSPOConfig) -> LossOutput:
    check_loss_inputs(inputs)
    check_kl_inputs(inputs, cfg)
    mask_NT = inputs.mask_NT
    logp_NT = upcast(inputs.logp_NT)
    len_N = mask_NT.sum(dim=1)
    has_tokens_N = len_N > 0  # an empty sequence has s = 1 but must add nothing, not -A
    inv_len_N = 1.0 / len_N.clamp(min=1).to(logp_NT.dtype)
    log_ratio_NT = log_ratio(logp_NT, upcast(inputs.old_logp_NT), mask_NT)
    s_N = torch.exp(log_ratio_NT.sum(dim=1) * inv_len_N)
    if inputs.adv_NT is not None:
        raise ValueError("GSPO's ratio is per sequence: it takes one advantage per sample (adv_N), not adv_NT")
    adv_N = upcast(inputs.adv_N)
    pg_N, low_N, high_N = clipped_surrogate(s_N, adv_N, clip_low=cfg.clip_low, clip_high=cfg.clip_high)
    seq_N = torch.where(has_tokens_N, pg_N, 0.0)

    kl_N = None
    if inputs.ref_logp_NT is not None:
        kl_NT = masked_kl_NT(logp_NT=logp_NT, ref_logp_NT=inputs.ref_logp_NT, mask_NT=mask_NT,
                             estimator=cfg.kl_estimator)
        kl_N = kl_NT.sum(dim=1) * inv_len_N
        if kl_in_loss(cfg):
            seq_N = seq_N + cfg.beta * kl_N

    with torch.no_grad():
        low_N, high_N = low_N & has_tokens_N, high_N & has_tokens_N
        n, tokens_N = float(mask_NT.shape[0]), mask_NT.sum(dim=1)
        stats = {  # fractions and the KL per sequence (the denominator), the ratio per token
            "kl": Mean(kl_N.sum().item() if kl_N is not None else 0.0, n),
            "clip_frac": Mean(float((low_N | high_N).sum().item()), n),
            "clip_low_frac": Mean(float(low_N.sum().item()), n),
            "clip_high_frac": Mean(float(high_N.sum().item()), n),
            "ratio_mean": Mean((s_N * tokens_N).sum().item(), float(tokens_N.sum().item())),  # a token weighs its s_i
            "ratio_max": Largest(torch.where(has_tokens_N, s_N, 0.0).max().item() if s_N.numel() else 0.0),
            **correction_figures(tokens=float(tokens_N.sum().item()), kept_NT=mask_NT),  # none: weights 1, none dropped
        }
    return LossOutput(loss_sum=seq_N.sum(), denom=n, stats=stats)


GSPO = Algorithm(name="gspo", config_cls=GSPOConfig, advantages=gspo_advantages, loss=gspo_loss)
