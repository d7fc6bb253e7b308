"""The PPO-style clipped surrogate, shared by every algorithm with a per-token ratio.

Per token t of sequence i, with ratio_it = exp(logp_it - old_logp_it):
    pg_it = -min(ratio_it * A_i, clip(ratio_it, 1 - clip_low, 1 + clip_high) * A_i)
    l_it  = pg_it + beta * kl_it - entropy_coef * H_it     (kl only when kl_in == "loss"; H: the token's entropy)
The algorithms differ only in how tokens are summed (a mean per sequence, or a plain sum) and in
what the batch denominator counts (`Normaliser`), so both are arguments here. Corrections for
samples the trained weights did not draw (importance weights against the generator's log-probs,
dual clip, a log-ratio clamp) are options of every such loss: tidal/algorithms/corrections.py.
"""
from __future__ import annotations

import torch
from pydantic import Field

from tidal.algorithms.base import (AlgoConfig, LossInputs, LossOutput, Normaliser, batch_denominator, check_loss_inputs,
                                   upcast)
from tidal.algorithms.corrections import CorrectionConfig, correction_figures, log_ratio
from tidal.algorithms.figures import Figure, Largest, Mean
from tidal.algorithms.kl import KLConfig, check_kl_inputs, kl_in_loss, masked_kl_NT


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

    @property
    def needs_entropy(self) -> bool:
        """The loss reads the policy's token entropy with its gradient (LossInputs.entropy_NT)."""
        return self.entropy_coef > 0

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


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, *, clip_low: float, clip_high: float):
    """-min(ratio * A, clip(ratio) * A), and where the clamp is the active branch (no gradient)."""
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    with torch.no_grad():
        low = (ratio < 1.0 - clip_low) & (adv < 0)
        high = (ratio > 1.0 + clip_high) & (adv > 0)
    return pg, low, high


def _weighted_sum(x_NT: torch.Tensor, mask_NT: torch.Tensor, inv_len_N1: torch.Tensor | None) -> torch.Tensor:
    """The masked sum of x, each sequence's tokens weighted 1/|o_i| where inv_len_N1 is given."""
    x_NT = torch.where(mask_NT, x_NT, 0.0)
    return (x_NT * inv_len_N1).sum() if inv_len_N1 is not None else x_NT.sum()


def _stats(inputs: LossInputs, *, mask_NT, inv_len_N1, per_seq: bool, denom: float, low_NT, high_NT, kl_NT, ratio_NT,
           weight_NT) -> dict[str, Figure]:
    """The micro-batch's statistics by metric name: fractions and the KL as sums in the normaliser's units
    over its denominator (per_seq: per-sequence means), the ratio and the correction per token."""
    def per_denom(x_NT: torch.Tensor) -> Mean:
        return Mean(_weighted_sum(x_NT, mask_NT, inv_len_N1 if per_seq else None).item(), denom)

    as_float = inv_len_N1.dtype
    ratio_NT = torch.where(mask_NT, ratio_NT, 0.0)  # mask_NT: the tokens a correction kept
    tokens = float(inputs.mask_NT.sum().item())  # every response token, kept or not
    return {
        "kl": per_denom(kl_NT) if kl_NT is not None else Mean(0.0, denom),  # to the reference
        "clip_frac": per_denom((low_NT | high_NT).to(as_float)),  # the clamp active, either way
        "clip_low_frac": per_denom(low_NT.to(as_float)),  # below 1 - clip_low (or the dual clip), A < 0
        "clip_high_frac": per_denom(high_NT.to(as_float)),  # above 1 + clip_high, A > 0
        # policy / old policy: 1 on a step's first pass
        "ratio_mean": Mean(ratio_NT.sum().item(), tokens),
        "ratio_max": Largest(ratio_NT.max().item() if mask_NT.numel() else 0.0),
        **correction_figures(tokens=tokens, kept_NT=mask_NT, weight_NT=weight_NT),
    }


def _penalties(tok_NT, inputs: LossInputs, cfg: ClipConfig, *, logp_NT, mask_NT):
    """The token loss with its penalties added (the corrections' weights are the surrogate's, not theirs): the KL
    to the reference (kl_in == "loss"), less the entropy bonus. -> (the token loss, the KL per token or None)."""
    kl_NT = None
    if inputs.ref_logp_NT is not None:
        kl_NT = masked_kl_NT(logp_NT=logp_NT, ref_logp_NT=inputs.ref_logp_NT, mask_NT=mask_NT,
                             estimator=cfg.kl_estimator)
        if kl_in_loss(cfg):
            tok_NT = tok_NT + cfg.beta * kl_NT
    if cfg.needs_entropy:
        if inputs.entropy_NT is None:
            raise ValueError("algorithm.entropy_coef > 0 needs the policy's token entropy (LossInputs.entropy_NT)")
        tok_NT = tok_NT - cfg.entropy_coef * upcast(inputs.entropy_NT)
    return tok_NT, kl_NT


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
    if corr.surrogate is not None:  # in place of the clipped surrogate (aipo)
        tok_NT, weight_NT = corr.surrogate(cfg.correction, logp_NT=logp_NT, behaviour_logp_NT=inputs.behaviour_logp_NT,
                                           adv_NT=adv_NT, mask_NT=mask_NT, log_ratio_clamp=cfg.log_ratio_clamp)
        low_NT = high_NT = torch.zeros_like(mask_NT)
    else:
        tok_NT, low_NT, high_NT = clipped_surrogate(ratio_NT, adv_NT, clip_low=cfg.clip_low, clip_high=cfg.clip_high)
    if cfg.clip_ratio_c is not None:  # dual clip: a negative advantage's loss is capped at -c * A
        cap_NT = -cfg.clip_ratio_c * adv_NT
        with torch.no_grad():
            low_NT = low_NT | ((adv_NT < 0) & (tok_NT > cap_NT))
        tok_NT = torch.where(adv_NT < 0, torch.minimum(tok_NT, cap_NT), tok_NT)
    if corr.weights is not None:  # a constant weight per token; some drop tokens (mis/icepop: outside the band)
        weight_NT, mask_NT = corr.weights(cfg.correction, old_logp_NT=upcast(inputs.old_logp_NT),
                                          behaviour_logp_NT=inputs.behaviour_logp_NT, mask_NT=mask_NT,
                                          log_ratio_clamp=cfg.log_ratio_clamp)
        tok_NT = weight_NT * tok_NT

    tok_NT, kl_NT = _penalties(tok_NT, inputs, cfg, logp_NT=logp_NT, mask_NT=mask_NT)
    # 1/|o_i|; clamp so an empty sequence contributes 0 instead of 0/0.
    inv_len_N1 = 1.0 / mask_NT.sum(dim=1, keepdim=True).clamp(min=1).to(logp_NT.dtype)
    loss_sum = _weighted_sum(tok_NT, mask_NT, inv_len_N1 if per_sequence_mean else None)
    denom = batch_denominator(normaliser, mask_NT, max_response_tokens=max_response_tokens)
    with torch.no_grad():
        stats = _stats(inputs, mask_NT=mask_NT, inv_len_N1=inv_len_N1, per_seq=normaliser == "sequences", denom=denom,
                       low_NT=low_NT, high_NT=high_NT, kl_NT=kl_NT, ratio_NT=ratio_NT, weight_NT=weight_NT)
    return LossOutput(loss_sum=loss_sum, denom=denom, stats=stats)
