"""Seeded sampling: what makes a sample a pure function of (run seed, step, prompt, sample, position),
whatever batch it is decoded in (docs/architecture.md, determinism rule 1).

Sample j of prompt i at step k draws its t-th token by inverse transform: one uniform u, a
counter-based hash of (its 63-bit seed, t), against the cumulative distribution of its row (the token
whose interval of the cumulative sum holds u times the row's total). No RNG stream is shared across
rows, so a sample does not depend on batching, chunking, or on how prompts are split over generator
ranks; the hash is integer arithmetic, exact on every device, and the cumulative sum runs along one
row at a time. One draw a row per token (the Gumbel-max sampler before it hashed every (row,
vocabulary entry): 78 ms a token at 8 rows x 151,936 on one thread).
"""
from __future__ import annotations

import hashlib

import torch

_MASK32 = 0xFFFFFFFF


def sample_seed(*, run_seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """The 63-bit seed of one sample; a cryptographic hash so nearby tuples share nothing."""
    key = f"{run_seed}/{step}/{prompt_index}/{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2^32 without int64 overflow: split x into 16-bit halves so no product passes 2^48.
    return (((x & 0xFFFF) * c) + ((((x >> 16) * c) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser: a bijection on 32-bit values with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniforms(seeds_R: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
    """float32 uniforms [R] in (0, 1): a pure function of (each row's seed, t); t is the token's position
    in the response, one for all rows or one per row.

    23 hash bits make u: (k + 0.5) / 2^23 is exact in float32 and lies strictly inside (0, 1). No
    float64 anywhere (Ascend kernels often lack it)."""
    lo_R, hi_R = seeds_R & _MASK32, seeds_R >> 32
    t_R = t.to(lo_R) if isinstance(t, torch.Tensor) else torch.full_like(lo_R, t)
    h_R = _fmix32(_fmix32(_fmix32(lo_R ^ _fmix32(t_R)) ^ hi_R) ^ 0x9E3779B9)
    return ((h_R >> 9).float() + 0.5) / 2.0**23


def draw(probs_RV: torch.Tensor, u_R: torch.Tensor) -> torch.Tensor:
    """Token ids [R]: each row's token whose interval of the row's cumulative sum holds u times the row's
    total. probs_RV need not sum to 1 (a mask's zeros are never drawn: their interval is empty)."""
    cdf_RV = probs_RV.cumsum(dim=-1)
    total_R1 = cdf_RV[:, -1:].contiguous()
    tok_R = torch.searchsorted(cdf_RV, u_R[:, None] * total_R1, right=True)[:, 0]
    # u * total may round up to the total: then the last token with mass (the first to reach the total)
    last_R = torch.searchsorted(cdf_RV, total_R1)[:, 0]
    return torch.minimum(tok_R, last_R)


def _top_p_mask(z_RV: torch.Tensor, top_p: float) -> torch.Tensor:
    """True on tokens outside each row's nucleus: the smallest set with probability >= top_p."""
    probs_RV, order_RV = torch.softmax(z_RV, dim=-1).sort(dim=-1, descending=True)
    before_RV = probs_RV.cumsum(dim=-1) - probs_RV  # mass strictly ahead of each token; 0 for the top one
    return torch.zeros_like(z_RV, dtype=torch.bool).scatter_(-1, order_RV, before_RV >= top_p)


def _top_k_mask(z_RV: torch.Tensor, top_k: int) -> torch.Tensor:
    """True on tokens below each row's k-th largest logit (ties with it stay in)."""
    kth_R1 = z_RV.topk(min(top_k, z_RV.shape[-1]), dim=-1).values[:, -1:]
    return z_RV < kth_R1


def sample_tokens(
    logits_RV: torch.Tensor, *, seeds_R: torch.Tensor, t: int | torch.Tensor, temperature: float, top_p: float, top_k: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [R] and their float32 sampling log-probs [R] (before top-p / top-k renormalisation,
    which is what the trainer computes)."""
    z_RV = logits_RV.float() / (temperature if temperature > 0 else 1.0)
    logp_RV = torch.log_softmax(z_RV, dim=-1)
    if temperature == 0:
        tok_R = z_RV.argmax(dim=-1)
    else:
        probs_RV = logp_RV.exp()
        if top_p < 1.0:
            probs_RV = probs_RV.masked_fill(_top_p_mask(z_RV, top_p), 0.0)
        if top_k > 0:
            probs_RV = probs_RV.masked_fill(_top_k_mask(z_RV, top_k), 0.0)
        tok_R = draw(probs_RV, uniforms(seeds_R, t))
    return tok_R, logp_RV.gather(-1, tok_R[:, None])[:, 0]
