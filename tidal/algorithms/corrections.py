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

from dataclasses import dataclass
from typing import Callable, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tidal.algorithms.figures import Mean
from tidal.common.registry import Registry


@dataclass(frozen=True)
class Correction:
    """One `correction.kind`: its default bounds (None: it takes no such bound), the levels it takes, and
    what it does to the clipped surrogate pg_t, held constant (no gradient) where it is a weight:
    - `weights(cfg, *, old_logp_NT, behaviour_logp_NT, mask_NT, log_ratio_clamp)` -> (weight_NT, keep_NT):
      pg_t is multiplied by weight_t; a token not in keep_NT leaves the loss (a dropped token);
    - `surrogate(cfg, *, logp_NT, behaviour_logp_NT, adv_NT, mask_NT, log_ratio_clamp)` -> (tok_NT, weight_NT):
      the token loss instead of pg_t, and the weight it reports (aipo).
    A kind of one's own is a `Correction` in a file of one's own, named `module:attr` in the config."""

    about: str
    low: float | None = None
    high: float | None = None
    levels: tuple[str, ...] = ("token",)
    weights: Callable | None = None
    surrogate: Callable | None = None

    @property
    def needs_behaviour(self) -> bool:
        """It reads the generator's log-probs of the sampled tokens."""
        return self.weights is not None or self.surrogate is not None


CORRECTIONS: Registry[Correction] = Registry("correction", key="correction.kind", plugin=Correction)


class CorrectionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: str = Field(
        "none", description="none, tis, mis, icepop, aipo, or module:attr naming a Correction of one's own "
                            "(tidal/algorithms/corrections.py has each formula)")
    level: Literal["token", "sequence"] = Field(
        "token", description="tis and mis: the ratio of each token, or of the whole sequence (their product)")
    low: float | None = Field(None, ge=0.0, description="mis/icepop: the band's lower end (None: 0 / 0.5)")
    high: float | None = Field(None, gt=0.0, description="tis: the cap; mis/icepop: the band's upper end; "
                               "aipo: rho (None: 2 / 2 / 5 / 2)")

    @model_validator(mode="after")
    def _check(self) -> "CorrectionConfig":
        entry = self.entry
        if self.level not in entry.levels:
            takes = " and ".join(CORRECTIONS.having(lambda c: self.level in c.levels))
            raise ValueError(f"correction.kind={self.kind!r} is per {' and '.join(entry.levels)}; "
                             f"correction.level={self.level} applies to {takes}")
        if self.low is not None and entry.low is None:
            raise ValueError(f"correction.kind={self.kind!r} has no lower bound; drop correction.low")
        if self.high is not None and entry.high is None:
            raise ValueError(f"correction.kind={self.kind!r} has no upper bound; drop correction.high")
        lo, hi = self.bounds
        if lo is not None and hi is not None and not lo < hi:
            raise ValueError(f"correction.low ({lo:g}) must be below correction.high ({hi:g})")
        return self

    @property
    def entry(self) -> Correction:
        return CORRECTIONS.get(self.kind)

    @property
    def bounds(self) -> tuple[float | None, float | None]:
        entry = self.entry
        return (self.low if self.low is not None else entry.low), (self.high if self.high is not None else entry.high)

    @property
    def needs_behaviour(self) -> bool:
        """The loss needs the generator's log-probs of the sampled tokens."""
        return self.entry.needs_behaviour


def correction_figures(*, tokens: float, kept_NT: torch.Tensor, weight_NT: torch.Tensor | None = None) -> dict:
    """A micro-batch's correction statistics (tidal/algorithms/figures.py): the mean weight over the tokens kept
    (`kept_NT`; 1 without a correction: weight_NT None) and the share of its `tokens` the correction dropped."""
    kept = float(kept_NT.sum().item())
    weights = torch.where(kept_NT, weight_NT, 0.0).sum().item() if weight_NT is not None else kept
    return {"is_weight_mean": Mean(weights, kept), "is_dropped_frac": Mean(tokens - kept, tokens)}


def clamp_log_ratio(log_ratio: torch.Tensor, limit: float | None) -> torch.Tensor:
    return log_ratio if limit is None else log_ratio.clamp(-limit, limit)


def log_ratio(num_NT: torch.Tensor, den_NT: torch.Tensor, mask_NT: torch.Tensor, *,
              limit: float | None = None) -> torch.Tensor:
    """log(num / den) of the real tokens, clamped to [-limit, limit]; 0 on padding, which may hold
    anything (even -inf): zeroed before any exp, so 0 * inf never turns into NaN."""
    return clamp_log_ratio(torch.where(mask_NT, num_NT - den_NT, 0.0), limit)


def train_infer_ratio(cfg: CorrectionConfig, *, old_logp_NT: torch.Tensor, behaviour_logp_NT: torch.Tensor,
                      mask_NT: torch.Tensor, log_ratio_clamp: float | None = None) -> torch.Tensor:
    """k_t = pi_old / mu of each token, or (correction.level=sequence) K_i, the product over the sequence's
    tokens, on each of its tokens; no gradient."""
    with torch.no_grad():
        sequence = cfg.level == "sequence"
        delta_NT = log_ratio(old_logp_NT.detach(), behaviour_logp_NT.to(old_logp_NT), mask_NT,
                             limit=None if sequence else log_ratio_clamp)
        if sequence:
            delta_NT = clamp_log_ratio(delta_NT.sum(dim=1, keepdim=True).expand_as(delta_NT), log_ratio_clamp)
        return torch.exp(delta_NT)


def tis_weights(cfg: CorrectionConfig, *, mask_NT: torch.Tensor, **logps) -> tuple[torch.Tensor, torch.Tensor]:
    """min(k, high), every token kept."""
    return train_infer_ratio(cfg, mask_NT=mask_NT, **logps).clamp(max=cfg.bounds[1]), mask_NT


def band_weights(cfg: CorrectionConfig, *, mask_NT: torch.Tensor, **logps) -> tuple[torch.Tensor, torch.Tensor]:
    """k where low <= k <= high, else the token (sequence: the whole sequence) dropped."""
    low, high = cfg.bounds
    k_NT = train_infer_ratio(cfg, mask_NT=mask_NT, **logps)
    inside_NT = (k_NT >= low) & (k_NT <= high)
    if cfg.level == "sequence":  # a sequence with no token is kept (it trains nothing anyway)
        inside_NT = inside_NT | ~mask_NT.any(dim=1, keepdim=True)
    return torch.where(inside_NT, k_NT, 0.0), mask_NT & inside_NT


def aipo_surrogate(cfg: CorrectionConfig, *, logp_NT: torch.Tensor, behaviour_logp_NT: torch.Tensor,
                   adv_NT: torch.Tensor, mask_NT: torch.Tensor,
                   log_ratio_clamp: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(pi / mu, rho) * A * grad log pi: the weight constant, exp(logp - logp) is 1 with logp's gradient."""
    with torch.no_grad():
        delta_NT = log_ratio(logp_NT.detach(), behaviour_logp_NT.to(logp_NT), mask_NT, limit=log_ratio_clamp)
        weight_NT = torch.exp(delta_NT).clamp(max=cfg.bounds[1])
    return -(weight_NT * adv_NT) * torch.exp(logp_NT - logp_NT.detach()), weight_NT


CORRECTIONS.register("none", Correction(about="the clipped surrogate as it is"))
CORRECTIONS.register("tis", Correction(about="truncated IS", high=2.0, levels=("token", "sequence"), weights=tis_weights))
CORRECTIONS.register("mis", Correction(about="masked IS", low=0.0, high=2.0, levels=("token", "sequence"),
                                       weights=band_weights))
CORRECTIONS.register("icepop", Correction(about="IcePop: masked IS per token", low=0.5, high=5.0, weights=band_weights))
CORRECTIONS.register("aipo", Correction(about="AIPO: the policy gradient weighted by min(pi / mu, rho)", high=2.0,
                                        surrogate=aipo_surrogate))
