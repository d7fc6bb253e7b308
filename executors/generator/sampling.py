"""Seeded sampling: what makes a sample a pure function of (run seed, step, prompt, sample, position),
whatever batch it is decoded in (docs/architecture.md, determinism rule 1).

Sample j of prompt i at step k draws its t-th token with Gumbel-max noise that is a counter-based
hash of (its 63-bit seed, t, token id). No RNG stream is shared across rows, so a sample does not
depend on batching, chunking, or on how prompts are split over generator ranks. Integer hashing is
exact on every device.
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


def gumbel_noise(seeds_R: torch.Tensor, t: int | torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 Gumbel(0, 1) noise [R, vocab]: a pure function of (each row's seed, t, token id); t is
    the token's position in the response, one for all rows or one per row.

    The hash is integer arithmetic, exact on every device; only the two logs after it are float32
    (no float64 anywhere: Ascend kernels often lack it, and [R, V] float64 per token was the
    sampler's largest tensor). 23 hash bits make u: (k + 0.5) / 2^23 is exact in float32 and lies
    strictly inside (0, 1), so the noise is finite, in [-2.81, 16.6]."""
    lo_R, hi_R = seeds_R & _MASK32, seeds_R >> 32
    t_R = t.to(lo_R) if isinstance(t, torch.Tensor) else torch.full_like(lo_R, t)
    step_R = _fmix32(_fmix32(lo_R ^ _fmix32(t_R)) ^ hi_R)
    tok_V = _fmix32(_mul32(torch.arange(vocab, device=seeds_R.device), 0x9E3779B9))
    h_RV = _fmix32(_fmix32(step_R[:, None] ^ tok_V) ^ hi_R[:, None])
    u_RV = ((h_RV >> 9).float() + 0.5) / 2.0**23
    return -torch.log(-torch.log(u_RV))


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
        score_RV = z_RV + gumbel_noise(seeds_R, t, z_RV.shape[-1])
        if top_p < 1.0:
            score_RV = score_RV.masked_fill(_top_p_mask(z_RV, top_p), float("-inf"))
        if top_k > 0:
            score_RV = score_RV.masked_fill(_top_k_mask(z_RV, top_k), float("-inf"))
        tok_R = score_RV.argmax(dim=-1)
    return tok_R, logp_RV.gather(-1, tok_R[:, None])[:, 0]
