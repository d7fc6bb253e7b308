"""KL estimators towards the reference policy, and where the penalty goes (loss or reward).

With samples x ~ pi (the policy) and log r = ref_logp - logp, the three estimators of
KL(pi || pi_ref) from J. Schulman, "Approximating KL Divergence" (2020):
    k1 = -log r                = logp - ref_logp            unbiased, can be negative
    k2 = (log r)^2 / 2                                      biased, low variance, >= 0
    k3 = (r - 1) - log r       = exp(ref - logp) - (ref - logp) - 1   unbiased, >= 0 (GRPO's)
All are plain functions of per-token log-probs; a sequence's KL is the sum over its tokens.

kl_in="loss": beta * kl_t is added to every token's loss (GRPO).
kl_in="reward": beta * sum_t kl_t is subtracted from the sequence's reward before advantages
(REINFORCE++, RLOO). The penalty is a reward, so it carries no gradient; it is computed from the
log-probs the samples were generated with, which the generator already returns.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from tidal.algorithms.base import AlgoConfig, LossInputs, upcast


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


class KLConfig(AlgoConfig):
    beta: float = Field(
        0.0, ge=0.0,
        description="KL coefficient towards the reference model; 0 needs no reference forward.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Per-token estimator of KL(policy || reference): k1, k2 or k3 (Schulman 2020).",
    )
    kl_in: Literal["loss", "reward"] = Field(
        "loss",
        description="loss: beta * kl per token in the loss; reward: beta * sum_t kl subtracted from the reward.",
    )

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0


# a plug-in config that does not derive from KLConfig simply has no KL
def kl_in_loss(cfg: AlgoConfig) -> bool:
    return cfg.needs_reference and cfg.kl_in == "loss"


def kl_in_reward(cfg: AlgoConfig) -> bool:
    return cfg.needs_reference and cfg.kl_in == "reward"


def masked_kl_NT(*, logp_NT: torch.Tensor, ref_logp_NT: torch.Tensor, mask_NT: torch.Tensor,
                 estimator: str = "k3") -> torch.Tensor:
    """Per-token KL, exactly 0 on padding (which may hold -inf/NaN from a real forward)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")
    # Zero both inputs on padding before the estimator: every estimator maps (0, 0) to 0.
    logp_NT = torch.where(mask_NT, upcast(logp_NT), 0.0)
    ref_NT = torch.where(mask_NT, upcast(ref_logp_NT), 0.0)
    return KL_ESTIMATORS[estimator](logp_NT, ref_NT)


def check_kl_inputs(inputs: LossInputs, cfg: AlgoConfig) -> None:
    if kl_in_loss(cfg) and inputs.ref_logp_NT is None:
        raise ValueError(f"beta={cfg.beta} with kl_in='loss' needs ref_logp_NT, got None")


def kl_penalised_rewards(*, rewards_N: torch.Tensor, logp_NT: torch.Tensor, ref_logp_NT: torch.Tensor,
                         mask_NT: torch.Tensor, cfg: KLConfig) -> torch.Tensor:
    """r_i - beta * sum_t kl_it: the KL-in-reward penalty, applied before advantages.

    `logp_NT` should be the log-probs the samples were generated with (the old policy), so the
    trainer needs only the reference forward before it can compute a group's advantages.
    """
    with torch.no_grad():
        kl_N = masked_kl_NT(logp_NT=logp_NT, ref_logp_NT=ref_logp_NT, mask_NT=mask_NT,
                            estimator=cfg.kl_estimator).sum(dim=1)
        r_N = upcast(rewards_N)
        return r_N - cfg.beta * kl_N.to(r_N.dtype)
