"""Batch-scope advantages (REINFORCE++) in a streaming trainer, exactly.

The advantage A_i = (s_i - mu) * c, with c = 1 / (sigma + eps) and mu, sigma over ALL scores s of
the step (every kept group, every data-parallel rank), is unknown when a group arrives. It is
still exact to train each group as it arrives, because in the first pass over a batch
old_logp = logp.detach(): every ratio is exactly 1, no clamp is active, and the loss is affine in
the advantages,
    L(a) = sum_i a_i * P_i(theta) + K(theta)          (K: the advantage-free part, the KL in the loss)
Gradients are linear in the loss, so with three evaluations of the same forward,
    grad L(A) = c * grad L(s) - c * mu * grad L(1) + (1 - c + c * mu) * grad L(0),
and grad L(0) = grad K is needed only when the KL is in the loss (else K = 0).

What the trainer does for an algorithm with advantage_scope == "batch":
  per group:        s_G = algo.advantages(rewards_G, cfg)       (the score, not yet normalised)
                    moments[group.index] = score_moments(s_G)   (gather these dicts over dp ranks)
  per micro-batch:  one forward; for name, adv_N in linear_passes(s_N, cfg).items():
                        out = algo.loss(LossInputs(..., adv_N=adv_N), cfg)
                        backward (retain_graph on all but the last) into its own accumulator acc[name]
                    denom and stats are taken from the "score" pass only (they do not depend on a).
  at the barrier:   mu, c = batch_mean_scale(moments, eps=cfg.eps)
                    grad = batch_normalise_at_barrier(at_score=acc["score"], at_one=acc["one"],
                                                      at_zero=acc.get("zero"), mu=mu, scale=c)
                    then divide by the summed denom exactly as for every other algorithm; the loss
                    metric combines the three loss sums the same way.
  later passes over the same batch (several optimizer steps per batch, ratio != 1: no longer
  linear) know mu and c already and use the exact advantages batch_normalise(s_N, mu=mu, scale=c).
Cost: one forward and 2 backward passes per micro-batch (3 with the KL in the loss).
Precision: exact in exact arithmetic; rounding in a pass's gradient is amplified by about |mu| * c,
harmless for rewards in [0, 1] and for the baseline variant (mu = 0 up to rounding).
"""
from __future__ import annotations

from typing import Mapping, TypeVar

import torch

from tidal.algorithms.base import AlgoConfig, check_rewards
from tidal.algorithms.kl import kl_in_loss

G = TypeVar("G", torch.Tensor, float)


def score_moments(score_G: torch.Tensor) -> torch.Tensor:
    """(count, sum, sum of squares) in float64: additive over groups and ranks."""
    check_rewards(score_G)
    s_G = score_G.detach().to(torch.float64)
    return torch.stack([torch.tensor(float(s_G.numel()), dtype=torch.float64), s_G.sum(), (s_G * s_G).sum()])


def batch_mean_scale(moments_by_group: Mapping[int, torch.Tensor], *, eps: float) -> tuple[float, float]:
    """mu and c = 1/(sigma + eps) of the batch (population std); c = 0 when all scores are equal.

    Summed in group-index order, so arrival order cannot change a bit (DESIGN "Determinism").
    """
    if not moments_by_group:
        raise ValueError("batch_mean_scale needs the moments of at least one group")
    total = torch.zeros(3, dtype=torch.float64)
    for index in sorted(moments_by_group):
        total = total + moments_by_group[index]
    n, s, ss = total.tolist()
    mu = s / n
    var = max(ss / n - mu * mu, 0.0)
    # E[s^2] - mu^2 leaves rounding dust (~1e-16 * E[s^2]) when every score is equal; that batch
    # has no signal, and dividing dust by eps would invent one.
    if var <= 1e-12 * (ss / n):
        return mu, 0.0
    return mu, 1.0 / (var ** 0.5 + eps)


def batch_normalise(score_N: torch.Tensor, *, mu: float, scale: float) -> torch.Tensor:
    """The exact advantages (s - mu) * c, once the batch statistics are known."""
    return (score_N - mu) * scale


def linear_passes(score_N: torch.Tensor, cfg: AlgoConfig) -> dict[str, torch.Tensor]:
    """The advantage vectors to evaluate the first-pass loss at: s, 1, and 0 if the loss has a KL term."""
    passes = {"score": score_N, "one": torch.ones_like(score_N)}
    if kl_in_loss(cfg):  # the only advantage-free term of the registered losses
        passes["zero"] = torch.zeros_like(score_N)
    return passes


def batch_normalise_at_barrier(*, at_score: G, at_one: G, at_zero: G | None = None, mu: float, scale: float) -> G:
    """grad L(A) from grad L(s), grad L(1) and grad L(0); works on gradients and on loss sums alike."""
    out = scale * at_score - (scale * mu) * at_one
    if at_zero is not None:
        out = out + (1.0 - scale + scale * mu) * at_zero
    return out
