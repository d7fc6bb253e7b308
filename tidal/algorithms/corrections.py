"""Corrections for samples the trained weights did not draw (`algorithm.correction`, `clip_ratio_c`,
`log_ratio_clamp`): options of every token-level loss (tidal/algorithms/token_loss.py).

Three log-probs of a sampled token y_t: mu (the generator's, as it sampled: the behaviour policy),
pi_old (the trainer's, at the step's starting weights: equal to mu up to the engines' arithmetic in
on-policy schedules, max_lag versions ahead of it under the offpolicy schedule, where it is decoupled
PPO's proximal policy) and pi (the policy being trained). With k_t = pi_old / mu (the
train/infer ratio of a token) and K_i = prod_t k_t (of a sequence), each correction reweights or
drops the clipped surrogate pg_t of tidal/algorithms/token_loss.py, its weights held constant (no gradient):

    tis     truncated IS (Yao et al. 2025)      l_t = min(k_t, high) * pg_t      (sequence: min(K_i, high))
    mis     masked IS                           l_t = k_t * pg_t where low <= k_t <= high, else dropped
                                                (sequence: K_i and the whole sequence dropped)
    icepop  IcePop (Ring-1T)                    mis at token level with its paper's band [0.5, 5]
    aipo    AIPO (LlamaRL section 6)            l_t = -min(pi_t / mu_t, rho) * A_t * logpi_t: the
                                                policy gradient weighted by the ratio to the
                                                behaviour policy clipped from above at rho = high
                                                (replaces the clipped surrogate: no ratio to pi_old)

A dropped token leaves the loss as if it were not in the response (no policy term, no KL, not in a
sequence's mean or the token count). `clip_ratio_c` (dual clip, Ye et al. 2020) caps the loss of a
token with a negative advantage at -c * A_t; `log_ratio_clamp` clamps every log-ratio above (pi/pi_old,
and pi_old/mu or pi/mu here) to [-L, L] before it is exponentiated, so a stale token cannot overflow.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

# (low, high) of each kind when the config leaves them out; None: the kind has no such bound
DEFAULT_BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "none": (None, None), "tis": (None, 2.0), "mis": (0.0, 2.0), "icepop": (0.5, 5.0), "aipo": (None, 2.0)}


class CorrectionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["none", "tis", "mis", "icepop", "aipo"] = Field(
        "none", description="none, tis, mis, icepop or aipo (tidal/algorithms/corrections.py has each formula)")
    level: Literal["token", "sequence"] = Field(
        "token", description="tis and mis: the ratio of each token, or of the whole sequence (their product)")
    low: float | None = Field(None, ge=0.0, description="mis/icepop: the band's lower end (None: 0 / 0.5)")
    high: float | None = Field(None, gt=0.0, description="tis: the cap; mis/icepop: the band's upper end; "
                               "aipo: rho (None: 2 / 2 / 5 / 2)")

    @model_validator(mode="after")
    def _check(self) -> "CorrectionConfig":
        low, high = DEFAULT_BOUNDS[self.kind]
        if self.kind in ("none", "icepop", "aipo") and self.level != "token":
            raise ValueError(f"correction.kind={self.kind!r} is per token; correction.level=sequence applies to "
                             f"tis and mis")
        if self.low is not None and low is None:
            raise ValueError(f"correction.kind={self.kind!r} has no lower bound; drop correction.low")
        if self.high is not None and high is None:
            raise ValueError("correction.kind='none' takes no bounds; name a kind or drop correction.high")
        lo, hi = self.bounds
        if lo is not None and hi is not None and not lo < hi:
            raise ValueError(f"correction.low ({lo:g}) must be below correction.high ({hi:g})")
        return self

    @property
    def bounds(self) -> tuple[float | None, float | None]:
        low, high = DEFAULT_BOUNDS[self.kind]
        return (self.low if self.low is not None else low), (self.high if self.high is not None else high)

    @property
    def needs_behaviour(self) -> bool:
        """The loss needs the generator's log-probs of the sampled tokens."""
        return self.kind != "none"


def clamp_log_ratio(log_ratio: torch.Tensor, limit: float | None) -> torch.Tensor:
    return log_ratio if limit is None else log_ratio.clamp(-limit, limit)


def log_ratio(num_NT: torch.Tensor, den_NT: torch.Tensor, mask_NT: torch.Tensor, *,
              limit: float | None = None) -> torch.Tensor:
    """log(num / den) of the real tokens, clamped to [-limit, limit]; 0 on padding, which may hold
    anything (even -inf): zeroed before any exp, so 0 * inf never turns into NaN."""
    return clamp_log_ratio(torch.where(mask_NT, num_NT - den_NT, 0.0), limit)


def is_weights(cfg: CorrectionConfig, *, old_logp_NT: torch.Tensor, behaviour_logp_NT: torch.Tensor,
               mask_NT: torch.Tensor, log_ratio_clamp: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_NT, keep_NT) of tis/mis/icepop: the constant weight of each token's loss, and the
    tokens that stay in it (False on padding and on what the band dropped)."""
    assert cfg.kind in ("tis", "mis", "icepop"), cfg.kind
    low, high = cfg.bounds
    with torch.no_grad():
        sequence = cfg.level == "sequence"
        delta_NT = log_ratio(old_logp_NT.detach(), behaviour_logp_NT.to(old_logp_NT), mask_NT,
                             limit=None if sequence else log_ratio_clamp)
        if sequence:  # the sequence's ratio, the product over its tokens, on each token
            delta_NT = clamp_log_ratio(delta_NT.sum(dim=1, keepdim=True).expand_as(delta_NT), log_ratio_clamp)
        k_NT = torch.exp(delta_NT)
        if cfg.kind == "tis":
            return k_NT.clamp(max=high), mask_NT
        inside_NT = (k_NT >= low) & (k_NT <= high)
        if cfg.level == "sequence":  # a sequence with no token is kept (it trains nothing anyway)
            inside_NT = inside_NT | ~mask_NT.any(dim=1, keepdim=True)
        return torch.where(inside_NT, k_NT, 0.0), mask_NT & inside_NT


def aipo_weights(*, logp_NT: torch.Tensor, behaviour_logp_NT: torch.Tensor, mask_NT: torch.Tensor, rho: float,
                 log_ratio_clamp: float | None = None) -> torch.Tensor:
    """min(pi / mu, rho) per token, constant (the policy gradient it weights carries the gradient)."""
    with torch.no_grad():
        delta_NT = log_ratio(logp_NT.detach(), behaviour_logp_NT.to(logp_NT), mask_NT, limit=log_ratio_clamp)
        return torch.exp(delta_NT).clamp(max=rho)
