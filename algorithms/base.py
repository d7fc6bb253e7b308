"""The algorithm contract: pure tensor functions, no distributed code.

An algorithm is an advantage function, a loss function and a config class with defaults.
The trainer calls `advantages` once per prompt group and `loss` once per micro-batch; the
batch-level denominator is applied once at the barrier (DESIGN.md "Normalisation that survives
streaming"), so `loss` returns a *sum* plus how much it adds to that denominator.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from pydantic import BaseModel, ConfigDict


class AlgoConfig(BaseModel):
    """Base for per-algorithm hyper-parameters (the `algorithm:` section of a run config)."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch of N response sequences, padded to T response tokens.

    `old_logp_NT` is the log-prob under the weights that generated the samples; with one optimizer
    step per batch it is `logp_NT.detach()`. `ref_logp_NT` is None when the KL coefficient is 0.
    """

    logp_NT: torch.Tensor
    old_logp_NT: torch.Tensor
    ref_logp_NT: torch.Tensor | None
    adv_N: torch.Tensor
    mask_NT: torch.Tensor  # bool, True on real response tokens


@dataclass(frozen=True)
class LossOutput:
    loss_sum: torch.Tensor  # scalar; summed over the micro-batch, NOT divided by the batch denominator
    denom: float  # this micro-batch's share of the batch denominator (e.g. N sequences)
    stats: dict[str, float] = field(default_factory=dict)  # sums (kl_sum, clip_sum, ...) for metrics


AdvantageFn = Callable[[torch.Tensor, AlgoConfig], torch.Tensor]  # rewards_G -> adv_G
LossFn = Callable[[LossInputs, AlgoConfig], LossOutput]


@dataclass(frozen=True)
class Algorithm:
    name: str
    config_cls: type[AlgoConfig]
    advantages: AdvantageFn
    loss: LossFn
