"""The native generation engine: batched KV-cache decoding over any HF causal LM.

Shaped like vLLM's offline API (SamplingParams, one request per prompt, n samples each) so the
generator executor can swap engines. Two properties matter more than speed here:

* Per-sample randomness (DESIGN.md determinism rule 1). Sample j of prompt i at step k draws its
  t-th token with Gumbel-max noise that is a counter-based hash of (its 63-bit seed, t, token id).
  No RNG stream is shared across rows, so a sample does not depend on batching, chunking, or on
  how prompts are split over generator ranks. Integer hashing is exact on every device.
* Streaming: a prompt group is yielded as soon as its G samples are finished.

Layout: prompts are taken `max_batch_prompts` at a time, left-padded, prefilled once, and their KV
cache is repeated G times. Finished samples stay in the batch (fed pad tokens) until their whole
group is done; then the group's rows are dropped from the batch and cache.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch
if TYPE_CHECKING:  # transformers loads with the first chunk: building a graph stays light
    import transformers

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    n: int  # G samples per prompt
    temperature: float = 1.0  # 0 means greedy (log-probs are then those of the raw logits)
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    max_new_tokens: int
    seed: int  # run seed

    def __post_init__(self):
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"n and max_new_tokens must be >= 1, got {self.n}, {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: every token), got {self.top_k}")


@dataclass(frozen=True, kw_only=True)
class PromptRequest:
    index: int  # prompt index within the step; part of every sample's seed
    prompt_ids: list[int] | torch.Tensor


@dataclass(kw_only=True)
class GroupCompletion:
    index: int
    prompt_ids_P: torch.Tensor
    response_ids: list[torch.Tensor]  # G ragged LongTensors, each ends with EOS if one was sampled
    logprobs: list[torch.Tensor]  # float32 log_softmax(logits / T) at the sampled tokens, before top-p
    finished_G: torch.Tensor  # bool, True where the sample hit EOS


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


def gumbel_noise(seeds_R: torch.Tensor, t: int, vocab: int) -> torch.Tensor:
    """float32 Gumbel(0, 1) noise [R, vocab]: a pure function of (each row's seed, t, token id).

    The hash is integer arithmetic, exact on every device; only the two logs after it are float32
    (no float64 anywhere: Ascend kernels often lack it, and [R, V] float64 per token was the
    sampler's largest tensor). 23 hash bits make u: (k + 0.5) / 2^23 is exact in float32 and lies
    strictly inside (0, 1), so the noise is finite, in [-2.81, 16.6]."""
    lo_R, hi_R = seeds_R & _MASK32, seeds_R >> 32
    step_R = _fmix32(_fmix32(lo_R ^ _fmix32(torch.full_like(lo_R, t))) ^ hi_R)
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
    logits_RV: torch.Tensor, *, seeds_R: torch.Tensor, t: int, temperature: float, top_p: float, top_k: int = 0
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


class NativeEngine:
    def __init__(self, model: transformers.PreTrainedModel, *, eos_token_id: int, pad_token_id: int, max_batch_prompts: int = 16):
        if max_batch_prompts < 1:
            raise ValueError(f"max_batch_prompts must be >= 1, got {max_batch_prompts}")
        self.model = model.eval()
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_batch_prompts = max_batch_prompts
        # remove_duplicate=False: a tied lm_head.weight is accepted under either of its names.

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_weights(self, shards, specs) -> None:
        """Nothing to do: the WEIGHTS channel receives straight into this engine's parameters."""

    def close(self) -> None:
        """Nothing to release."""

    def generate(
        self, requests: list[PromptRequest], params: SamplingParams, *, step: int
    ) -> Iterator[GroupCompletion]:
        """Stream the G-sample group of every request, each as soon as it is complete."""
        indices = [r.index for r in requests]
        if len(set(indices)) != len(indices):
            raise ValueError(f"duplicate prompt indices in one generate call: {sorted(indices)}")
        prompts = [torch.as_tensor(r.prompt_ids, dtype=torch.long).reshape(-1).cpu() for r in requests]
        if any(p.numel() == 0 for p in prompts):
            raise ValueError("empty prompt")
        return self._stream(indices, prompts, params, step)  # validated now, not at the first next()

    def _stream(self, indices, prompts, params, step) -> Iterator[GroupCompletion]:
        for start in range(0, len(prompts), self.max_batch_prompts):
            end = start + self.max_batch_prompts
            chunk = _Chunk(self, indices[start:end], prompts[start:end], params, step)
            while not chunk.exhausted:
                # Yield outside inference_mode: the caller (a trainer in the same thread) runs
                # between yields and must not inherit it; the yielded tensors are plain clones.
                yield from chunk.advance()


class _Chunk:
    """Decoding state of up to max_batch_prompts prompts x G samples.

    Results live in chunk-row space R = C*G (row c*G + j is sample j of prompt c); the model's
    batch (cache, logits, masks, seeds) lives in live-row space B and shrinks as groups finish.
    """

    def __init__(self, engine: NativeEngine, indices: list[int], prompts: list[torch.Tensor],
                 params: SamplingParams, step: int):
        self.engine, self.params, self.indices, self.prompts = engine, params, indices, prompts
        C, G, T = len(prompts), params.n, params.max_new_tokens
        self.tokens_RT = torch.full((C * G, T), engine.pad_token_id, dtype=torch.long)
        self.logp_RT = torch.zeros(C * G, T)
        self.len_R = torch.zeros(C * G, dtype=torch.long)
        self.eos_R = torch.zeros(C * G, dtype=torch.bool)
        self.done_R = torch.zeros(C * G, dtype=torch.bool)
        self.yielded_C = torch.zeros(C, dtype=torch.bool)
        self.rows_B = torch.arange(C * G)
        self.seeds_B = torch.tensor(
            [sample_seed(run_seed=params.seed, step=step, prompt_index=i, sample_index=j)
             for i in indices for j in range(G)], device=engine.device)
        self.t = 0
        self._prefill()

    @property
    def exhausted(self) -> bool:
        return bool(self.yielded_C.all())

    def advance(self) -> Iterator[GroupCompletion]:
        """Decode one token for every live sample, then hand out the groups that just finished."""
        for c in self._decode_one():
            rows = range(c * self.params.n, (c + 1) * self.params.n)
            yield GroupCompletion(
                index=self.indices[c],
                prompt_ids_P=self.prompts[c].clone(),
                response_ids=[self.tokens_RT[r, : self.len_R[r]].clone() for r in rows],
                logprobs=[self.logp_RT[r, : self.len_R[r]].clone() for r in rows],
                finished_G=self.eos_R[rows.start : rows.stop].clone(),
            )

    @torch.inference_mode()
    def _prefill(self) -> None:
        G, dev, model, pad = self.params.n, self.engine.device, self.engine.model, self.engine.pad_token_id
        P = max(len(p) for p in self.prompts)
        ids_CP = torch.full((len(self.prompts), P), pad, dtype=torch.long)
        mask_CP = torch.zeros(len(self.prompts), P, dtype=torch.long)
        for c, p in enumerate(self.prompts):  # left padding: every prompt ends at column P-1
            ids_CP[c, P - len(p):] = p
            mask_CP[c, P - len(p):] = 1
        pos_CP = (mask_CP.cumsum(-1) - 1).clamp(min=0)
        from transformers import DynamicCache

        self.cache = DynamicCache(config=model.config)
        out = model(input_ids=ids_CP.to(dev), attention_mask=mask_CP.to(dev), position_ids=pos_CP.to(dev),
                    past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        # Prefill once per prompt, then give each of its G samples a copy of its cache rows.
        self.cache.batch_repeat_interleave(G)
        self.logits_BV = out.logits[:, -1].float().repeat_interleave(G, dim=0)
        self.mask_BS = mask_CP.to(dev).repeat_interleave(G, dim=0)
        self.pos_B = torch.tensor([len(p) for p in self.prompts], device=dev).repeat_interleave(G)

    @torch.inference_mode()
    def _decode_one(self) -> list[int]:
        """Sample token t of every live row and feed it; return the chunk positions of finished groups."""
        p, eng, t = self.params, self.engine, self.t
        tok_B, logp_B = sample_tokens(self.logits_BV, seeds_R=self.seeds_B, t=t,
                                      temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)
        tok_B, logp_B = tok_B.cpu(), logp_B.cpu()
        writing_B = ~self.done_R[self.rows_B]  # rows already past EOS keep their pad filler
        rows = self.rows_B[writing_B]
        self.tokens_RT[rows, t] = tok_B[writing_B]
        self.logp_RT[rows, t] = logp_B[writing_B]
        self.len_R[rows] += 1
        hit = rows[tok_B[writing_B] == eng.eos_token_id]
        self.eos_R[hit] = True
        self.done_R[hit] = True
        self.t += 1
        if self.t == p.max_new_tokens:
            self.done_R[:] = True
        newly_C = self.done_R.view(-1, p.n).all(dim=1) & ~self.yielded_C
        self.yielded_C |= newly_C
        keep_B = ~self.yielded_C[self.rows_B // p.n]
        if keep_B.any():
            if not keep_B.all():  # drop the rows of yielded groups from the batch and the cache
                keep = keep_B.nonzero()[:, 0]
                self.cache.batch_select_indices(keep.to(eng.device))
                self.rows_B, tok_B = self.rows_B[keep], tok_B[keep]
                keep = keep.to(eng.device)
                self.seeds_B, self.mask_BS, self.pos_B = self.seeds_B[keep], self.mask_BS[keep], self.pos_B[keep]
            feed_B = torch.where(self.done_R[self.rows_B], eng.pad_token_id, tok_B).to(eng.device)
            self.mask_BS = torch.cat([self.mask_BS, torch.ones_like(self.mask_BS[:, :1])], dim=1)
            out = eng.model(input_ids=feed_B[:, None], attention_mask=self.mask_BS,
                            position_ids=self.pos_B[:, None], past_key_values=self.cache, use_cache=True)
            self.logits_BV = out.logits[:, -1].float()
            self.pos_B = self.pos_B + 1
        return newly_C.nonzero()[:, 0].tolist()
