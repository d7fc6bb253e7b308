"""Penalties: terms added to every kept token's loss after the surrogate and its correction weights
(tidal/algorithms/token_loss.py), l_it = w_it * pg_it + sum_p x_p,it.

Each is a registered `Penalty`, a function a researcher reads alone:
    kl       x_it = beta * kl_it, the KL to the reference (kl_in="loss"; tidal/algorithms/kl.py's estimators);
             its figure `kl` is reported whenever the reference runs (kl_in="reward" too)
    entropy  x_it = -entropy_coef * H_it, the policy's token entropy at the sampling temperature, with its
             gradient (a bonus)
A penalty of one's own is a `Penalty` in a file of one's own, named with its coefficient in
`algorithm.penalties` ({"module:attr": coef}); its figures are reported as trainer/<name> like any loss
statistic (tidal/algorithms/figures.py). The corrections' weights do not scale a penalty, and a token a
correction dropped (mis, icepop) leaves it too: a penalty sees only the kept tokens' mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tidal.algorithms.base import LossInputs, upcast
from tidal.algorithms.figures import Figure, Mean
from tidal.algorithms.kl import kl_in_loss, masked_kl_NT
from tidal.common.registry import Registry

# x_NT -> its masked sum in the loss normaliser's units over the batch denominator (a per-sequence mean
# for GRPO's "sequences", a token mean otherwise): how a penalty reports a per-token quantity
PerDenom = Callable[[torch.Tensor], Mean]


@dataclass(frozen=True, kw_only=True)
class Penalty:
    """One term of the token loss: `term(inputs, cfg, *, coef, logp_NT, mask_NT, per_denom)` ->
    (x_NT added to every token's loss, or None to add nothing; {metric name: figure}). logp_NT is the
    policy's (at least float32, with its gradient); mask_NT the tokens the loss keeps. `needs_*`: the
    inputs it reads besides those (the trainer then runs the reference / keeps the entropy's gradient).
    `coef_field`: a built-in's coefficient is that field of the algorithm's config; a penalty of one's own
    has none (its coefficient is written beside its name in algorithm.penalties)."""

    about: str
    term: Callable[..., tuple[torch.Tensor | None, dict[str, Figure]]]
    needs_reference: bool = False
    needs_entropy: bool = False
    coef_field: str | None = None


PENALTIES: Registry[Penalty] = Registry("penalty", key="algorithm.penalties", plugin=Penalty)


def kl_term(inputs: LossInputs, cfg, *, coef: float, logp_NT, mask_NT, per_denom: PerDenom):
    if inputs.ref_logp_NT is None:
        return None, {"kl": per_denom(torch.zeros_like(logp_NT))}
    kl_NT = masked_kl_NT(logp_NT=logp_NT, ref_logp_NT=inputs.ref_logp_NT, mask_NT=mask_NT, estimator=cfg.kl_estimator)
    return (coef * kl_NT if kl_in_loss(cfg) else None), {"kl": per_denom(kl_NT)}


def entropy_term(inputs: LossInputs, cfg, *, coef: float, logp_NT, mask_NT, per_denom: PerDenom):
    if not coef:
        return None, {}
    if inputs.entropy_NT is None:
        raise ValueError("algorithm.entropy_coef > 0 needs the policy's token entropy (LossInputs.entropy_NT)")
    return -(coef * upcast(inputs.entropy_NT)), {}


# in this order: the loss adds the KL before the entropy bonus (the order of a float sum is part of its bits)
PENALTIES.register("kl", Penalty(about="beta * KL to the reference", term=kl_term, needs_reference=True,
                                 coef_field="beta"))
PENALTIES.register("entropy", Penalty(about="-entropy_coef * the token's entropy", term=entropy_term,
                                      needs_entropy=True, coef_field="entropy_coef"))


def penalties_of(cfg) -> list[tuple[Penalty, float]]:
    """The penalties a loss adds, in order, with their coefficients: the built-in ones (in the order registered;
    their coefficients from their fields), then `algorithm.penalties` in the order written."""
    built_in = [(p, getattr(cfg, p.coef_field)) for _, p in PENALTIES.entries()]
    return built_in + [(PENALTIES.get(name), coef) for name, coef in cfg.penalties.items()]


def check_penalties(penalties: dict[str, float]) -> None:
    """`algorithm.penalties` names penalties of one's own; a built-in one has its own field."""
    for name in penalties:
        if name in PENALTIES:
            raise ValueError(f"algorithm.penalties: {name!r} is built in; set algorithm.{PENALTIES.get(name).coef_field}")
        PENALTIES.get(name)  # imported now: a wrong name is refused before any rank starts
