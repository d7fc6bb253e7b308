"""Objective terms of one's own, as a user adds them: this file, named in the config (no line in Tidal's
registries): `algorithm.correction.kind=tests.objective_plugin:GEO_TIS`,
`algorithm.surrogate=tests.objective_plugin:UNCLIPPED`, `algorithm.penalties={tests.objective_plugin:OLD_K2: c}`."""
from __future__ import annotations

import torch

from tidal.algorithms.corrections import Correction, CorrectionConfig, log_ratio
from tidal.algorithms.penalties import Penalty
from tidal.algorithms.surrogates import Surrogate


def geo_tis_weights(cfg: CorrectionConfig, *, old_logp_NT: torch.Tensor, behaviour_logp_NT: torch.Tensor,
                    mask_NT: torch.Tensor, log_ratio_clamp: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level TIS by the geometric mean: min(exp(mean_t log k_t), high) on every token of a
    sequence (k_t = pi_old / mu), every token kept."""
    with torch.no_grad():
        delta_NT = log_ratio(old_logp_NT.detach(), behaviour_logp_NT.to(old_logp_NT), mask_NT, limit=log_ratio_clamp)
        mean_N1 = delta_NT.sum(dim=1, keepdim=True) / mask_NT.sum(dim=1, keepdim=True).clamp(min=1)
        return torch.exp(mean_N1).clamp(max=cfg.bounds[1]).expand_as(delta_NT), mask_NT


GEO_TIS = Correction(about="sequence TIS by the geometric mean of the token ratios", high=2.0, weights=geo_tis_weights)


def unclipped(cfg, *, ratio_NT: torch.Tensor, adv_NT: torch.Tensor, logp_NT: torch.Tensor):
    """-r * A: the importance-sampled policy gradient with no clip (nothing is ever clipped)."""
    never_NT = torch.zeros_like(ratio_NT, dtype=torch.bool)
    return -(ratio_NT * adv_NT), never_NT, never_NT


UNCLIPPED = Surrogate(about="the unclipped importance-sampled policy gradient", loss=unclipped)


def old_k2(inputs, cfg, *, coef: float, logp_NT: torch.Tensor, mask_NT: torch.Tensor, per_denom):
    """coef * (log pi - log pi_old)^2 / 2: a trust region to the step's starting weights (0 on a step's first
    pass), reported as trainer/old_k2."""
    k2_NT = 0.5 * log_ratio(logp_NT, inputs.old_logp_NT.to(logp_NT), mask_NT) ** 2
    return coef * k2_NT, {"old_k2": per_denom(k2_NT)}


OLD_K2 = Penalty(about="a squared log-ratio to the old policy", term=old_k2)
