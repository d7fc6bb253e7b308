"""GRPO: Group Relative Policy Optimization (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300).

For a prompt q the generator samples a group of G responses o_1..o_G with rewards r_1..r_G.

Advantage (outcome supervision, the same value for every token of o_i):
    A_i = (r_i - mean(r)) / (std(r) + eps)        (or r_i - mean(r) with scale_std=False)

Per token t of o_i, with ratio_it = exp(logp_it - old_logp_it):
    pg_it = -min(ratio_it * A_i, clip(ratio_it, 1 - clip_low, 1 + clip_high) * A_i)
    k3_it = exp(ref_logp_it - logp_it) - (ref_logp_it - logp_it) - 1     (unbiased, always >= 0)
    l_it  = pg_it + beta * k3_it

Objective: J = 1/G * sum_i 1/|o_i| * sum_t l_it, averaged over the B prompts of the batch.
`grpo_loss` returns only sum_i (1/|o_i| * sum_t l_it) over its micro-batch and denom = N; the
trainer divides the accumulated sum by B*G once, at the barrier, so a sequence's loss never
depends on which micro-batch it landed in.
"""
from __future__ import annotations

import torch
from pydantic import Field

from algorithms.base import Algorithm, AlgoConfig, LossInputs, LossOutput


class GRPOConfig(AlgoConfig):
    clip_low: float = Field(
        0.2, ge=0.0, lt=1.0, description="Lower clip: the ratio is clamped below at 1 - clip_low."
    )
    clip_high: float = Field(
        0.2, ge=0.0,
        description="Upper clip: the ratio is clamped above at 1 + clip_high (clip-higher when > clip_low).",
    )
    beta: float = Field(
        0.0, ge=0.0,
        description="KL coefficient towards the reference model (k3 per token); 0 needs no reference forward.",
    )
    scale_std: bool = Field(
        True, description="Divide group-centred rewards by the group std; False keeps r - mean (Dr. GRPO)."
    )
    eps: float = Field(
        1e-6, gt=0.0, description="Added to the group std before dividing, so near-constant groups stay finite."
    )


def _up(t: torch.Tensor) -> torch.Tensor:
    # bf16/fp16 log-probs lose the small differences the ratio is made of; float64 stays float64.
    return t.to(torch.promote_types(t.dtype, torch.float32))


def grpo_advantages(rewards_G: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """Group-relative advantages for the G samples of one prompt.

    The std is the POPULATION std (divide by G, unbiased=False): it describes the group as it is,
    is defined for G=1 (0, not NaN), and matches the normalisation a user gets by z-scoring the
    group by hand. A group whose rewards are all equal carries no signal: its advantages are
    exactly zero (checked explicitly, because r - mean can leave float dust like 1e-17).
    """
    if rewards_G.dim() != 1 or rewards_G.numel() == 0:
        raise ValueError(f"rewards_G must be a non-empty 1-D tensor, got shape {tuple(rewards_G.shape)}")
    if not bool(torch.isfinite(rewards_G).all()):
        raise ValueError(f"rewards_G contains NaN/inf: {rewards_G.tolist()}")
    r_G = _up(rewards_G)
    if bool((r_G == r_G[0]).all()):
        return torch.zeros_like(r_G)
    centred_G = r_G - r_G.mean()
    if not cfg.scale_std:
        return centred_G
    return centred_G / (r_G.std(unbiased=False) + cfg.eps)


def _check_shapes(inputs: LossInputs) -> None:
    shape = tuple(inputs.logp_NT.shape)
    if len(shape) != 2:
        raise ValueError(f"logp_NT must be 2-D (N, T), got shape {shape}")
    named = {"old_logp_NT": inputs.old_logp_NT, "mask_NT": inputs.mask_NT}
    if inputs.ref_logp_NT is not None:
        named["ref_logp_NT"] = inputs.ref_logp_NT
    for name, t in named.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} like logp_NT")
    if tuple(inputs.adv_N.shape) != shape[:1]:
        raise ValueError(f"adv_N has shape {tuple(inputs.adv_N.shape)}, expected ({shape[0]},)")
    if inputs.mask_NT.dtype != torch.bool:
        raise ValueError(f"mask_NT must be bool, got {inputs.mask_NT.dtype}")


def grpo_loss(inputs: LossInputs, cfg: GRPOConfig) -> LossOutput:
    """Clipped surrogate + beta * k3 KL; per-sequence token mean, summed over sequences."""
    _check_shapes(inputs)
    if cfg.beta > 0 and inputs.ref_logp_NT is None:
        raise ValueError(f"beta={cfg.beta} needs ref_logp_NT, got None")
    mask_NT = inputs.mask_NT
    # Padding positions may hold anything (even -inf); zero them before exp so that 0 * inf
    # never turns into NaN in the forward or the backward.
    logp_NT = _up(inputs.logp_NT)
    log_ratio_NT = torch.where(mask_NT, logp_NT - _up(inputs.old_logp_NT), 0.0)
    ratio_NT = torch.exp(log_ratio_NT)
    adv_N1 = _up(inputs.adv_N).unsqueeze(1)
    clipped_NT = ratio_NT.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    tok_NT = -torch.minimum(ratio_NT * adv_N1, clipped_NT * adv_N1)

    kl_NT = None
    if inputs.ref_logp_NT is not None:
        d_NT = torch.where(mask_NT, _up(inputs.ref_logp_NT) - logp_NT, 0.0)
        kl_NT = torch.exp(d_NT) - d_NT - 1.0
        if cfg.beta > 0:
            tok_NT = tok_NT + cfg.beta * kl_NT

    # 1/|o_i|; clamp so an empty sequence contributes 0 instead of 0/0.
    inv_len_N = 1.0 / mask_NT.sum(dim=1).clamp(min=1).to(logp_NT.dtype)

    def seq_mean_sum(x_NT: torch.Tensor) -> torch.Tensor:
        return (torch.where(mask_NT, x_NT, 0.0).sum(dim=1) * inv_len_N).sum()

    loss_sum = seq_mean_sum(tok_NT)
    with torch.no_grad():
        # "Clipped" = the clamp is the active branch of the min, i.e. the token gets no gradient.
        low_NT = (ratio_NT < 1.0 - cfg.clip_low) & (adv_N1 < 0)
        high_NT = (ratio_NT > 1.0 + cfg.clip_high) & (adv_N1 > 0)
        stats = {
            "clip_low_sum": seq_mean_sum(low_NT.float()).item(),
            "clip_high_sum": seq_mean_sum(high_NT.float()).item(),
            "clip_sum": seq_mean_sum((low_NT | high_NT).float()).item(),
            "kl_sum": seq_mean_sum(kl_NT).item() if kl_NT is not None else 0.0,
            "ratio_sum": seq_mean_sum(ratio_NT).item(),
            "adv_sum": adv_N1.sum().item(),
        }
    return LossOutput(loss_sum=loss_sum, denom=float(mask_NT.shape[0]), stats=stats)


GRPO = Algorithm(name="grpo", config_cls=GRPOConfig, advantages=grpo_advantages, loss=grpo_loss)
