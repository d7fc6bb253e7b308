"""Surrogates: the policy term pg_it of every token-level loss (tidal/algorithms/token_loss.py), from the
ratio r_it = pi / pi_old and the advantage A_it (`algorithm.surrogate`). Each is a registered function a
researcher reads alone:

    clip   PPO's clipped surrogate (Schulman et al. 2017; clip-higher, DAPO):
               pg = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)
           a token whose clamp is active gets no gradient
    cispo  CISPO (MiniMax-M1, arXiv:2506.13585): REINFORCE weighted by the clipped ratio, held constant,
               pg = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi       (value: -clip(r) * A)
           every token keeps its gradient; the clip bounds only its weight (the paper sets no lower bound:
           clip_low close to 1)

A surrogate of one's own is a `Surrogate` in a file of one's own, named `module:attr` in the config. The
corrections (tidal/algorithms/corrections.py) weight pg afterwards; AIPO replaces it (no ratio to pi_old).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tidal.common.registry import Registry


@dataclass(frozen=True, kw_only=True)
class Surrogate:
    """`loss(cfg, *, ratio_NT, adv_NT, logp_NT)` -> (pg_NT, low_NT, high_NT): each token's policy term and
    where its ratio was clipped below / above (bool, no gradient: trainer/clip_low_frac, clip_high_frac).
    logp_NT (the policy's, with its gradient) is there for a surrogate that needs grad log pi itself."""

    about: str
    loss: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


SURROGATES: Registry[Surrogate] = Registry("surrogate", key="algorithm.surrogate", plugin=Surrogate)


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, *, clip_low: float, clip_high: float):
    """-min(ratio * A, clip(ratio) * A), and where the clamp is the active branch (no gradient)."""
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    with torch.no_grad():
        low = (ratio < 1.0 - clip_low) & (adv < 0)
        high = (ratio > 1.0 + clip_high) & (adv > 0)
    return pg, low, high


def clip_loss(cfg, *, ratio_NT: torch.Tensor, adv_NT: torch.Tensor, logp_NT: torch.Tensor):
    return clipped_surrogate(ratio_NT, adv_NT, clip_low=cfg.clip_low, clip_high=cfg.clip_high)


def cispo_loss(cfg, *, ratio_NT: torch.Tensor, adv_NT: torch.Tensor, logp_NT: torch.Tensor):
    with torch.no_grad():
        weight_NT = ratio_NT.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        low_NT, high_NT = ratio_NT < 1.0 - cfg.clip_low, ratio_NT > 1.0 + cfg.clip_high
    # exp(logp - sg(logp)) is 1 with logp's gradient: the value is -w * A, the gradient -w * A * grad log pi
    return -(weight_NT * adv_NT) * torch.exp(logp_NT - logp_NT.detach()), low_NT, high_NT


SURROGATES.register("clip", Surrogate(about="PPO's clipped surrogate", loss=clip_loss))
SURROGATES.register("cispo", Surrogate(about="CISPO: REINFORCE weighted by the clipped ratio, held constant",
                                       loss=cispo_loss))
