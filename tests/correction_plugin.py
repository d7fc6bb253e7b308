"""A correction of one's own, as a user adds one: this file, named in the config as
`algorithm.correction.kind=tests.correction_plugin:GEO_TIS` (no line in Tidal's registry)."""
from __future__ import annotations

import torch

from tidal.algorithms.corrections import Correction, CorrectionConfig, log_ratio


def geo_tis_weights(cfg: CorrectionConfig, *, old_logp_NT: torch.Tensor, behaviour_logp_NT: torch.Tensor,
                    mask_NT: torch.Tensor, log_ratio_clamp: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level TIS by the geometric mean: min(exp(mean_t log k_t), high) on every token of a
    sequence (k_t = pi_old / mu), every token kept."""
    with torch.no_grad():
        delta_NT = log_ratio(old_logp_NT.detach(), behaviour_logp_NT.to(old_logp_NT), mask_NT, limit=log_ratio_clamp)
        mean_N1 = delta_NT.sum(dim=1, keepdim=True) / mask_NT.sum(dim=1, keepdim=True).clamp(min=1)
        return torch.exp(mean_N1).clamp(max=cfg.bounds[1]).expand_as(delta_NT), mask_NT


GEO_TIS = Correction(about="sequence TIS by the geometric mean of the token ratios", high=2.0, weights=geo_tis_weights)
