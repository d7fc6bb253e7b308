"""The token-level loss shared by every algorithm with a per-token ratio, composed of registered terms.

Per token t of sequence i, with ratio_it = exp(logp_it - old_logp_it):
    pg_it = surrogate(ratio_it, A_it)          clip (PPO's, the default) or cispo: tidal/algorithms/surrogates.py
    l_it  = w_it * pg_it + sum_p x_p,it        w: a correction's weight (tidal/algorithms/corrections.py: tis,
                                               mis, icepop; aipo replaces pg), x_p: the penalties
                                               (tidal/algorithms/penalties.py: beta * kl, -entropy_coef * H, ...)
The algorithms differ only in how tokens are summed (a mean per sequence, or a plain sum) and in
what the batch denominator counts (`Normaliser`), so both are arguments here. Each term returns its
statistics by name, reported as trainer/<name> (tidal/algorithms/figures.py).
"""
from __future__ import annotations

import torch
from pydantic import Field, model_validator

from tidal.algorithms.base import (AlgoConfig, LossInputs, LossOutput, Normaliser, batch_denominator, check_loss_inputs,
                                   upcast)
from tidal.algorithms.corrections import CorrectionConfig, correction_figures, log_ratio
from tidal.algorithms.figures import Figure, Largest, Mean
from tidal.algorithms.kl import KLConfig, check_kl_inputs
from tidal.algorithms.penalties import PENALTIES, check_penalties, penalties_of
from tidal.algorithms.surrogates import SURROGATES


class ClipConfig(KLConfig):
    clip_low: float = Field(
        0.2, ge=0.0, lt=1.0, description="Lower clip: the ratio is clamped below at 1 - clip_low."
    )
    clip_high: float = Field(
        0.2, ge=0.0,
        description="Upper clip: the ratio is clamped above at 1 + clip_high (clip-higher when > clip_low).",
    )
    correction: CorrectionConfig = Field(
        default_factory=CorrectionConfig,
        description="importance weights against the generator's log-probs: none, tis, mis, icepop, aipo")
    clip_ratio_c: float | None = Field(
        None, gt=1.0, description="dual clip: a token with a negative advantage loses at most -c * A (None: off)")
    log_ratio_clamp: float | None = Field(
        None, gt=0.0, description="clamp every log-ratio to [-L, L] before exp (None: off)")
    entropy_coef: float = Field(
        0.0, ge=0.0, description="entropy bonus: l_it -= coef * H_it, the policy's token entropy at the sampling "
        "temperature, with its gradient (0: off)")
    surrogate: str = Field(
        "clip", description="the policy term: clip (PPO's), cispo, or module:attr naming a Surrogate of one's own "
                            "(tidal/algorithms/surrogates.py)")
    penalties: dict[str, float] = Field(
        default_factory=dict, description="penalties of one's own added to every token's loss: {module:attr: "
        "coefficient}, each naming a Penalty (tidal/algorithms/penalties.py; the KL and entropy are beta and "
        "entropy_coef)")

    @model_validator(mode="after")
    def _terms(self) -> "ClipConfig":
        SURROGATES.get(self.surrogate)  # a wrong name (or an unimportable module:attr) refused here
        check_penalties(self.penalties)
        if self.correction.entry.surrogate is not None and self.surrogate != "clip":
            raise ValueError(f"algorithm.surrogate={self.surrogate!r} with correction.kind={self.correction.kind!r}: "
                             f"that correction replaces the surrogate; use one or the other")
        return self

    @property
    def needs_entropy(self) -> bool:
        """The loss reads the policy's token entropy with its gradient (LossInputs.entropy_NT)."""
        return self.entropy_coef > 0 or any(PENALTIES.get(name).needs_entropy for name in self.penalties)

    @property
    def needs_reference(self) -> bool:
        """The reference's forward: a KL (beta > 0, in the loss or the reward) or a penalty that reads it."""
        return super().needs_reference or any(PENALTIES.get(name).needs_reference for name in self.penalties)

    @property
    def needs_behaviour(self) -> bool:
        """The loss reads the generator's log-probs of the sampled tokens (LossInputs.behaviour_logp_NT)."""
        return self.correction.needs_behaviour


class ResponseBudget(AlgoConfig):
    """For a loss normalised by the longest response the generator may produce (Dr. GRPO, DAPO)."""

    max_response_tokens: int = Field(1024, ge=1, description="L; set it to the generator's max_new_tokens.")

    def fit_generation(self, *, max_new_tokens: int) -> "ResponseBudget":
        # unless the user set L, it is what the generator may produce: a smaller L is refused at the
        # first longer response, a larger one only scales every step down
        if "max_response_tokens" in self.model_fields_set:
            return self
        return self.model_copy(update={"max_response_tokens": max_new_tokens})


def _weighted_sum(x_NT: torch.Tensor, mask_NT: torch.Tensor, inv_len_N1: torch.Tensor | None) -> torch.Tensor:
    """The masked sum of x, each sequence's tokens weighted 1/|o_i| where inv_len_N1 is given."""
    x_NT = torch.where(mask_NT, x_NT, 0.0)
    return (x_NT * inv_len_N1).sum() if inv_len_N1 is not None else x_NT.sum()


def _stats(inputs: LossInputs, *, mask_NT, per_denom, as_float, low_NT, high_NT, ratio_NT, weight_NT) -> dict[str, Figure]:
    """The surrogate's and the correction's statistics by metric name: fractions as sums in the normaliser's
    units over its denominator (`per_denom`), the ratio and the correction per token."""
    ratio_NT = torch.where(mask_NT, ratio_NT, 0.0)  # mask_NT: the tokens a correction kept
    tokens = float(inputs.mask_NT.sum().item())  # every response token, kept or not
    return {
        "clip_frac": per_denom((low_NT | high_NT).to(as_float)),  # the clamp active, either way
        "clip_low_frac": per_denom(low_NT.to(as_float)),  # below 1 - clip_low (or the dual clip), A < 0
        "clip_high_frac": per_denom(high_NT.to(as_float)),  # above 1 + clip_high, A > 0
        # policy / old policy: 1 on a step's first pass
        "ratio_mean": Mean(ratio_NT.sum().item(), tokens),
        "ratio_max": Largest(ratio_NT.max().item() if mask_NT.numel() else 0.0),
        **correction_figures(tokens=tokens, kept_NT=mask_NT, weight_NT=weight_NT),
    }


def _dual_clip(tok_NT, low_NT, adv_NT, *, c: float):
    """A negative advantage's loss capped at -c * A (the cap counts as clipped below)."""
    cap_NT = -c * adv_NT
    with torch.no_grad():
        low_NT = low_NT | ((adv_NT < 0) & (tok_NT > cap_NT))
    return torch.where(adv_NT < 0, torch.minimum(tok_NT, cap_NT), tok_NT), low_NT


def token_level_loss(inputs: LossInputs, cfg: ClipConfig, *, normaliser: Normaliser, per_sequence_mean: bool,
                     max_response_tokens: int | None = None) -> LossOutput:
    """Sum over the micro-batch of l_it, weighted 1/|o_i| (per_sequence_mean) or 1 (token sum).

    Stats are summed in the normaliser's units, so stat / denom is a mean: per-sequence means
    for "sequences", token sums for "tokens" and "constant".
    """
    check_loss_inputs(inputs)
    check_kl_inputs(inputs, cfg)
    if cfg.needs_behaviour and inputs.behaviour_logp_NT is None:
        raise ValueError(f"correction.kind={cfg.correction.kind!r} needs the generator's log-probs (behaviour_logp_NT)")
    mask_NT = inputs.mask_NT
    logp_NT = upcast(inputs.logp_NT)
    ratio_NT = torch.exp(log_ratio(logp_NT, upcast(inputs.old_logp_NT), mask_NT, limit=cfg.log_ratio_clamp))
    adv_NT = inputs.token_advantages()  # [N, 1] for per-sample advantages
    corr, weight_NT = cfg.correction.entry, None
    if corr.surrogate is not None:  # in place of the surrogate (aipo)
        tok_NT, weight_NT = corr.surrogate(cfg.correction, logp_NT=logp_NT, behaviour_logp_NT=inputs.behaviour_logp_NT,
                                           adv_NT=adv_NT, mask_NT=mask_NT, log_ratio_clamp=cfg.log_ratio_clamp)
        low_NT = high_NT = torch.zeros_like(mask_NT)
    else:
        tok_NT, low_NT, high_NT = SURROGATES.get(cfg.surrogate).loss(cfg, ratio_NT=ratio_NT, adv_NT=adv_NT, logp_NT=logp_NT)
    if cfg.clip_ratio_c is not None:
        tok_NT, low_NT = _dual_clip(tok_NT, low_NT, adv_NT, c=cfg.clip_ratio_c)
    if corr.weights is not None:  # a constant weight per token; some drop tokens (mis/icepop: outside the band)
        weight_NT, mask_NT = corr.weights(cfg.correction, old_logp_NT=upcast(inputs.old_logp_NT),
                                          behaviour_logp_NT=inputs.behaviour_logp_NT, mask_NT=mask_NT,
                                          log_ratio_clamp=cfg.log_ratio_clamp)
        tok_NT = weight_NT * tok_NT

    # 1/|o_i|; clamp so an empty sequence contributes 0 instead of 0/0.
    inv_len_N1 = 1.0 / mask_NT.sum(dim=1, keepdim=True).clamp(min=1).to(logp_NT.dtype)
    per_seq_N1 = inv_len_N1 if normaliser == "sequences" else None
    denom = batch_denominator(normaliser, mask_NT, max_response_tokens=max_response_tokens)

    @torch.no_grad()
    def per_denom(x_NT: torch.Tensor) -> Mean:
        return Mean(_weighted_sum(x_NT, mask_NT, per_seq_N1).item(), denom)

    stats: dict[str, Figure] = {}
    for penalty, coef in penalties_of(cfg):  # the corrections' weights are the surrogate's, not theirs
        x_NT, figures = penalty.term(inputs, cfg, coef=coef, logp_NT=logp_NT, mask_NT=mask_NT, per_denom=per_denom)
        tok_NT = tok_NT if x_NT is None else tok_NT + x_NT
        stats |= figures
    loss_sum = _weighted_sum(tok_NT, mask_NT, inv_len_N1 if per_sequence_mean else None)
    stats |= _stats(inputs, mask_NT=mask_NT, per_denom=per_denom, as_float=logp_NT.dtype, low_NT=low_NT,
                    high_NT=high_NT, ratio_NT=ratio_NT, weight_NT=weight_NT)
    return LossOutput(loss_sum=loss_sum, denom=denom, stats=stats)
