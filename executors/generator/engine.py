"""The native generation engine: batched KV-cache decoding over any HF causal LM.

Shaped like vLLM's offline API (SamplingParams, one request per prompt, n samples each) so the
generator executor can swap engines. Two properties matter more than speed here:

* Per-sample randomness (DESIGN.md determinism rule 1). Sample j of prompt i at step k draws its
  t-th token with Gumbel-max noise that is a counter-based hash of (its 63-bit seed, t, token id).
  No RNG stream is shared across rows, so a sample does not depend on batching, chunking, or on
  how prompts are split over generator ranks. Integer hashing is exact on every device.
* Streaming: a prompt group is yielded as soon as its G samples are finished.

Layout: up to `max_batch_prompts` groups decode together. A prompt is prefilled once and its KV
cache repeated G times. Finished samples stay in the batch (fed pad tokens) until their whole group
is done; then the group's rows leave the batch and cache. Admission: `chunked` (the default) starts
the next max_batch_prompts prompts when the whole batch is done; `continuous` gives a freed slot to
the next prompt at once, left-padded into the running cache. Continuous keeps the batch full (fewer,
fuller forwards: what a device whose decode step costs the same for 8 rows as for 64 wants), but on
CPU a forward's cost follows its rows, and the padding makes attention longer: measured 6-8% slower
there on the default shape, 2% faster with a longer tail (bench/admission.py), with the same samples.
"""
from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

import torch

from modeling import moe

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
class Resume:
    """A group cut at an earlier call's token budget (partial rollouts), to be continued: its samples
    keep their seeds (those of `step`, `index`) and their tokens so far, and go on from there."""
    step: int  # the step that seeded its samples
    index: int  # its prompt index in that step
    response_ids: list[torch.Tensor]  # G x [R_i]: an unfinished sample's every token so far
    logprobs: list[torch.Tensor]
    finished_G: torch.Tensor  # samples that already ended (EOS): they write nothing more

    @property
    def t(self) -> int:
        """Tokens decoded so far: an unfinished sample's length (the group's samples decode together)."""
        return max(r.numel() for r in self.response_ids)


@dataclass(frozen=True, kw_only=True)
class PromptRequest:
    index: int  # prompt index within the call; part of every sample's seed (unless resumed)
    prompt_ids: list[int] | torch.Tensor
    resume: Resume | None = None  # continue a cut group instead of starting the prompt afresh


@dataclass(kw_only=True)
class GroupCompletion:
    index: int
    prompt_ids_P: torch.Tensor
    response_ids: list[torch.Tensor]  # G ragged LongTensors, each ends with EOS if one was sampled
    logprobs: list[torch.Tensor]  # float32 log_softmax(logits / T) at the sampled tokens, before top-p
    finished_G: torch.Tensor  # bool, True where the sample hit EOS (with turns: its episode ended)
    loss_masks: list[torch.Tensor] | None = None  # with turns: G x [R_i] bool, True on sampled tokens
    # an MoE model's expert ids per token and routed layer, [prompt, response_1..G] (modeling/moe.py
    # pack); None for a dense model, and for multi-turn and partial rollouts (not recorded there)
    routing: list[torch.Tensor] | None = None
    # the call's token budget ran out before every sample ended: a partial group, continued by a
    # later call (PromptRequest.resume) rather than trained
    cut: bool = False


class Turns(Protocol):
    """A multi-turn rollout's side of the engine (executors/generator/rollouts.py). With it, a sample's
    response is its turns and the observations between them; `max_tokens` caps each turn (at most
    `SamplingParams.max_new_tokens`), `max_total_tokens` the whole response."""

    max_total_tokens: int

    def max_tokens(self, *, index: int, sample: int) -> int:
        """The token cap of the current turn of sample `sample` of prompt `index` (asked again after
        every turn: the environment may change it)."""

    def __call__(self, *, index: int, sample: int, turn_ids: torch.Tensor, ended: bool) -> list[int] | None:
        """Sample `sample` of prompt `index` ended a turn (`ended`: with EOS, else at the turn's cap):
        the observation's token ids to append before its next turn, or None: its episode is over."""


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


ADMISSIONS = ("continuous", "chunked")


class NativeEngine:
    def __init__(self, model: transformers.PreTrainedModel, *, eos_token_id: int, pad_token_id: int,
                 max_batch_prompts: int = 16, admission: str = "chunked"):
        if max_batch_prompts < 1:
            raise ValueError(f"max_batch_prompts must be >= 1, got {max_batch_prompts}")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        self.model = model.eval()
        # a bf16 model's logits in float32, and its attention in float32, as the trainer computes them
        # (training/head.py, training/packed_attention.py: off a packed row its attention is SDPA's)
        from modeling.head import Fp32Head  # DTensor: loaded on the generator's ranks only

        self._fp32_head = Fp32Head.install(model)
        if next(model.parameters()).dtype != torch.float32 and model.config._attn_implementation == "sdpa":
            from modeling.packed_attention import install

            install(model)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        # an MoE model records the experts each token was routed to, for the trainer to replay (modeling/moe.py)
        self.routing = moe.install(model)
        if self.routing is not None:
            self.routing.mode = "record"
        self.max_batch_prompts = max_batch_prompts
        self.admission = admission

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_weights(self, shards, specs) -> None:
        """The WEIGHTS channel received straight into this engine's parameters: only the float32
        copy of a bf16 head is stale."""
        if self._fp32_head is not None:
            self._fp32_head.refresh()

    def release(self) -> None:
        """Nothing to give back: the KV cache lives only within a `generate` call, and the executors
        that time-share this device allocate from the same process's caching allocator."""

    def wake(self) -> None:
        pass

    def close(self) -> None:
        """Nothing to release."""

    def generate(
        self, requests: list[PromptRequest], params: SamplingParams, *, step: int, stop: Callable[[], bool] = lambda: False,
        turns: Turns | None = None, budget: int | None = None,
    ) -> Iterator[GroupCompletion]:
        """Stream the G-sample group of every request, each as soon as it is complete. `stop()` is
        asked before every decode iteration: True ends the stream there (the groups in flight are
        dropped: a stop request abandons the step, common/stop.py). `turns`: a multi-turn rollout's
        observations, appended to a sample's cache as it ends a turn (its KV is kept, never recomputed).
        `budget`: tokens each sample may write in this call (partial rollouts); a group whose samples
        have not all ended by then comes back `cut`, to be resumed by a later call. A resumed group's
        KV is computed again from its tokens (prefill): the weights have changed since they were
        written, and the trainer scores every token with the weights of its step."""
        indices = [r.index for r in requests]
        if len(set(indices)) != len(indices):
            raise ValueError(f"duplicate prompt indices in one generate call: {sorted(indices)}")
        assert budget is None or (budget >= 1 and turns is None), "partial rollouts are single-turn"
        prompts = [torch.as_tensor(r.prompt_ids, dtype=torch.long).reshape(-1).cpu() for r in requests]
        if any(p.numel() == 0 for p in prompts):
            raise ValueError("empty prompt")
        waiting = [(r.index, p, r.resume) for r, p in zip(requests, prompts)]
        return self._stream(waiting, params, step, stop, turns, budget)  # validated now, not at the first next()

    def _stream(self, waiting, params, step, stop, turns, budget) -> Iterator[GroupCompletion]:
        waiting = collections.deque(waiting)
        batch = _Batch(self, params, step, turns, budget)
        while (waiting or batch.groups) and not stop():
            free = self.max_batch_prompts - len(batch.groups)
            # continuous: a finished group's slot takes the next prompt at once; chunked: the next
            # max_batch_prompts prompts start when the whole batch is done
            if waiting and free and (self.admission == "continuous" or not batch.groups):
                batch.admit([waiting.popleft() for _ in range(min(free, len(waiting)))])
            # Yield outside inference_mode: the caller (a trainer in the same thread) runs between
            # yields and must not inherit it; the yielded tensors are plain clones.
            yield from batch.advance()


@dataclass
class _Rows:
    """What each row of the decode batch carries, batch row first. The cache and the attention mask
    have a sequence dimension and live beside it (_Batch)."""
    logits_BV: torch.Tensor  # the next token's logits (device)
    pos_B: torch.Tensor  # the next token's position id (device)
    seeds_B: torch.Tensor  # the sample's seed (device)
    t_B: torch.Tensor  # tokens decoded so far (CPU, as the rest); with turns: 1 once the environment ended the episode
    len_B: torch.Tensor  # tokens written: t, or up to the EOS
    eos_B: torch.Tensor
    tokens_BT: torch.Tensor
    logp_BT: torch.Tensor
    sampled_BT: torch.Tensor  # bool, True where the model sampled the token (not an observation)
    turn_start_B: torch.Tensor  # with turns: where the row's current turn began in its response
    stop_B: torch.Tensor  # t at which the row's call budget ends (max_new_tokens without one)
    routes_BTLk: torch.Tensor  # the expert ids each fed response token was routed to ([R, 0] when not recorded)

    def _tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def __getitem__(self, rows) -> "_Rows":
        """Rows by a slice (views) or an index tensor (copies), each on its own device."""
        return _Rows(*(x[rows if isinstance(rows, slice) else rows.to(x.device)] for x in self._tensors()))

    def cat(self, other: "_Rows") -> "_Rows":
        return _Rows(*(torch.cat([a, b]) for a, b in zip(self._tensors(), other._tensors())))


class _Batch:
    """The decode batch: G rows per live group, groups in admission order (batch row b is sample
    b % G of group b // G); everything a row has written lives in the batch too, so one step is the
    same few tensor ops for any number of groups. Every row's newest token sits in the last cache
    column; rows admitted later are left-padded (mask 0) to the batch's length, and columns no live
    row attends to are dropped as groups leave."""

    def __init__(self, engine: NativeEngine, params: SamplingParams, step: int, turns: Turns | None = None,
                 budget: int | None = None):
        self.engine, self.params, self.step, self.turns = engine, params, step, turns
        # a response holds every turn and observation under turns; one turn's tokens otherwise
        self.T = params.max_new_tokens if turns is None else turns.max_total_tokens
        self.budget = budget
        # an MoE model's routing is recorded for single-turn groups generated whole (a resumed group's
        # tokens and an observation are fed in other shapes; their routing is the trainer's own)
        recording = engine.routing is not None and turns is None and budget is None
        self.moe_shape = engine.routing.shape if recording else None
        self.prompt_routes: dict[int, torch.Tensor] = {}  # prompt index -> [P, L, k]
        self.groups: list[tuple[int, torch.Tensor]] = []  # (prompt index, prompt ids) per live group
        self.rows: _Rows | None = None
        self.cache = self.mask_BS = None

    def admit(self, prompts: list[tuple[int, torch.Tensor, Resume | None]]) -> None:
        """New prompts join the batch, each prefilled once (its G samples share a copy of the cache);
        a resumed group's samples then feed their own tokens so far."""
        fresh = [(i, p) for i, p, resume in prompts if resume is None]
        resumed = [(i, p, resume) for i, p, resume in prompts if resume is not None]
        if fresh:
            self._join(*self._prefill_fresh(fresh), groups=fresh)
        if resumed:
            self._join(*self._prefill_resumed(resumed), groups=[(i, p) for i, p, _ in resumed])

    def _stop_at(self, t: int) -> int:
        return self.params.max_new_tokens if self.budget is None else min(t + self.budget, self.params.max_new_tokens)

    def _prefill(self, ids: list[torch.Tensor]):
        """Prefill the sequences left-padded together: (cache, mask, last logits, each sequence's
        routing [P_c, L, k] or None)."""
        from transformers import DynamicCache

        eng, dev = self.engine, self.engine.device
        P = max(len(p) for p in ids)
        ids_CP = torch.full((len(ids), P), eng.pad_token_id, dtype=torch.long)
        mask_CP = torch.zeros(len(ids), P, dtype=torch.long)
        for c, p in enumerate(ids):  # left padding: every sequence ends at column P-1
            ids_CP[c, P - len(p):] = p
            mask_CP[c, P - len(p):] = 1
        pos_CP = (mask_CP.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=eng.model.config)
        out = eng.model(input_ids=ids_CP.to(dev), attention_mask=mask_CP.to(dev), position_ids=pos_CP.to(dev),
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
        routes_CPLk = self._routes(len(ids), P)
        routes = None if routes_CPLk is None else [routes_CPLk[c, P - len(p):] for c, p in enumerate(ids)]
        return cache, mask_CP.to(dev), out.logits[:, -1].float(), routes

    def _routes(self, B: int, W: int) -> torch.Tensor | None:
        """The expert ids the forward just run chose for its [B, W] tokens, [B, W, L, k] compact, on the
        CPU; None when this batch records none (the hooks' lists are emptied either way)."""
        routing = self.engine.routing
        if routing is None:
            return None
        recorded, routing.recorded = routing.recorded, []
        if self.moe_shape is None:
            return None
        return torch.stack(recorded, dim=1).view(B, W, len(self.moe_shape.layers), -1).to(self.moe_shape.id_dtype).cpu()

    def _new_rows(self, R: int, **given) -> _Rows:
        eng, T = self.engine, self.T
        empty = dict(t_B=torch.zeros(R, dtype=torch.long), len_B=torch.zeros(R, dtype=torch.long),
                     eos_B=torch.zeros(R, dtype=torch.bool), tokens_BT=torch.full((R, T), eng.pad_token_id, dtype=torch.long),
                     logp_BT=torch.zeros(R, T), sampled_BT=torch.zeros(R, T, dtype=torch.bool),
                     turn_start_B=torch.zeros(R, dtype=torch.long), stop_B=torch.full((R,), self._stop_at(0)),
                     routes_BTLk=torch.zeros(R, 0, dtype=torch.uint8) if (m := self.moe_shape) is None else
                     torch.full((R, T, len(m.layers), m.top_k), moe.UNRECORDED).to(m.id_dtype))
        return _Rows(**{**empty, **given})

    @torch.inference_mode()
    def _prefill_fresh(self, prompts: list[tuple[int, torch.Tensor]]):
        """Prefill the new prompts together, once each, and give each of its G samples a copy of its
        cache rows; they join the batch with their first logits."""
        G, dev = self.params.n, self.engine.device
        cache, mask_CP, logits_CV, routes = self._prefill([p for _, p in prompts])
        if routes is not None:
            self.prompt_routes.update({i: r for (i, _), r in zip(prompts, routes)})
        cache.batch_repeat_interleave(G)
        rows = self._new_rows(
            len(prompts) * G, logits_BV=logits_CV.repeat_interleave(G, dim=0),
            pos_B=torch.tensor([len(p) for _, p in prompts], device=dev).repeat_interleave(G),
            seeds_B=torch.tensor([sample_seed(run_seed=self.params.seed, step=self.step, prompt_index=i, sample_index=j)
                                  for i, _ in prompts for j in range(G)], device=dev))
        return cache, mask_CP.repeat_interleave(G, dim=0), rows

    @torch.inference_mode()
    def _prefill_resumed(self, prompts: list[tuple[int, torch.Tensor, Resume]]):
        """Prefill the resumed groups' prompts once each (their G samples share a copy, as fresh ones
        do), then every unfinished sample's tokens so far, ragged, in one forward (right-aligned, mask
        0 before them). An ended sample writes nothing more: it feeds one pad, its row only keeps the
        group together."""
        G, eng, dev = self.params.n, self.engine, self.engine.device
        cache, mask_CP, _, _ = self._prefill([p for _, p, _ in prompts])
        cache.batch_repeat_interleave(G)
        samples = [(p, res, j) for _, p, res in prompts for j in range(G)]
        chunks = [[] if bool(res.finished_G[j]) else res.response_ids[j].tolist() for _, res, j in samples]
        ids_BW, mask_BW, pos_BW = _right_aligned(chunks, torch.tensor([len(p) for p, _, _ in samples]),
                                                 pad=eng.pad_token_id)
        mask_BS = torch.cat([mask_CP.repeat_interleave(G, dim=0), mask_BW.to(dev)], dim=1)
        out = eng.model(input_ids=ids_BW.to(dev), attention_mask=mask_BS, position_ids=pos_BW.to(dev),
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
        self._routes(*ids_BW.shape)  # not recorded for a resumed group
        t0 = torch.tensor([res.t for _, res, _ in samples])
        rows = self._new_rows(len(samples), logits_BV=out.logits[:, -1].float(), pos_B=(pos_BW[:, -1] + 1).to(dev),
                              seeds_B=torch.tensor([sample_seed(run_seed=self.params.seed, step=res.step,
                                                                prompt_index=res.index, sample_index=j)
                                                    for _, res, j in samples], device=dev),
                              t_B=t0, stop_B=torch.tensor([self._stop_at(int(t)) for t in t0]))
        for b, (_, res, j) in enumerate(samples):
            n = res.response_ids[j].numel()
            rows.tokens_BT[b, :n], rows.logp_BT[b, :n] = res.response_ids[j], res.logprobs[j]
            rows.len_B[b], rows.eos_B[b] = n, bool(res.finished_G[j])
        return cache, mask_BS, rows

    def _join(self, cache, mask_BS: torch.Tensor, rows: _Rows, *, groups: list[tuple[int, torch.Tensor]]) -> None:
        """New rows and their cache join the batch behind the live ones, left-padded to one length."""
        if not self.groups:
            self.cache, self.mask_BS, self.rows = cache, mask_BS, rows
        else:
            S = max(self.mask_BS.shape[1], mask_BS.shape[1])
            for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
                mine.keys = torch.cat([_left_pad(mine.keys, S, dim=2), _left_pad(theirs.keys, S, dim=2)])
                mine.values = torch.cat([_left_pad(mine.values, S, dim=2), _left_pad(theirs.values, S, dim=2)])
            self.mask_BS = torch.cat([_left_pad(self.mask_BS, S, dim=1), _left_pad(mask_BS, S, dim=1)])
            self.rows = self.rows.cat(rows)
        self.groups += groups

    def advance(self) -> Iterator[GroupCompletion]:
        """Decode one token for every live sample, then hand out the groups that just finished
        (cloned here, outside inference mode: plain tensors for the consumer)."""
        for (index, prompt_P), rows in self._decode_one():
            lengths = rows.len_B.tolist()
            yield GroupCompletion(index=index, prompt_ids_P=prompt_P.clone(),
                                  response_ids=[rows.tokens_BT[j, :n].clone() for j, n in enumerate(lengths)],
                                  logprobs=[rows.logp_BT[j, :n].clone() for j, n in enumerate(lengths)],
                                  finished_G=rows.eos_B.clone(),
                                  loss_masks=None if self.turns is None else
                                  [rows.sampled_BT[j, :n].clone() for j, n in enumerate(lengths)],
                                  cut=self.budget is not None and
                                  bool((~rows.eos_B & (rows.t_B < self.params.max_new_tokens)).any()),
                                  routing=None if self.moe_shape is None else moe.pack(
                                      self.prompt_routes.pop(index),
                                      [rows.routes_BTLk[j, :n] for j, n in enumerate(lengths)], self.moe_shape))

    @torch.inference_mode()
    def _decode_one(self) -> list[tuple[tuple[int, torch.Tensor], _Rows]]:
        """Sample the next token of every row and feed it; return the groups that finished, each
        with its G rows."""
        p, eng, G, r = self.params, self.engine, self.params.n, self.rows
        if self.turns is not None:
            return self._decode_turn()
        tok_B, logp_B = sample_tokens(r.logits_BV, seeds_R=r.seeds_B, t=r.t_B.to(r.seeds_B.device),
                                      temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)
        tok_B, logp_B = tok_B.cpu(), logp_B.cpu()
        writing = (~r.eos_B).nonzero()[:, 0]  # a sample past its EOS keeps its pad filler
        r.tokens_BT[writing, r.t_B[writing]] = tok_B[writing]
        r.logp_BT[writing, r.t_B[writing]] = logp_B[writing]
        r.len_B[writing] += 1
        r.eos_B[writing] |= tok_B[writing] == eng.eos_token_id
        r.t_B += 1
        done_B = r.eos_B | (r.t_B >= r.stop_B)  # stop_B: max_new_tokens, or the call's budget
        finished = self._leave(done_B)
        if self.rows is None:
            return finished
        done_B = done_B[self._kept] if finished else done_B
        feed_B = torch.where(done_B, eng.pad_token_id, tok_B[self._kept] if finished else tok_B).to(eng.device)
        self._feed(feed_B[:, None], torch.ones_like(feed_B[:, None]), self.rows.pos_B[:, None])
        routes_B1Lk = self._routes(len(feed_B), 1)
        if routes_B1Lk is not None:  # a row that fed its new token (not a pad): that token's experts
            fed = (~done_B).nonzero()[:, 0]
            self.rows.routes_BTLk[fed, self.rows.t_B[fed] - 1] = routes_B1Lk[fed, 0]
        return finished

    @torch.inference_mode()
    def _decode_turn(self) -> list[tuple[tuple[int, torch.Tensor], _Rows]]:
        """`_decode_one` with turns: a row whose turn ends hands it to the rollout, and the observation
        it gets back is fed with its last token in the same forward (its KV appended to the row's).
        The noise of a token is indexed by its position in the response, unique across turns."""
        p, eng, G, r = self.params, self.engine, self.params.n, self.rows
        tok_B, logp_B = sample_tokens(r.logits_BV, seeds_R=r.seeds_B, t=r.len_B.to(r.seeds_B.device),
                                      temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)
        tok_B, logp_B = tok_B.cpu(), logp_B.cpu()
        chunks = [[] for _ in range(len(tok_B))]  # what each row feeds: its last token, and an observation
        for b in (~r.eos_B).nonzero()[:, 0].tolist():  # eos_B: the row's episode is over
            n = int(r.len_B[b])
            r.tokens_BT[b, n], r.logp_BT[b, n], r.sampled_BT[b, n] = tok_B[b], logp_B[b], True
            r.len_B[b] = n = n + 1
            ended = int(tok_B[b]) == eng.eos_token_id
            chunks[b] = [int(tok_B[b])]
            k, j = self.groups[b // G][0], b % G
            if not ended and n - int(r.turn_start_B[b]) < self.turns.max_tokens(index=k, sample=j):
                if n == self.T:  # a turn that never ends is cut at the budget (finished stays False)
                    r.eos_B[b] = True
                continue
            obs = self.turns(index=k, sample=j, turn_ids=r.tokens_BT[b, int(r.turn_start_B[b]):n].clone(), ended=ended)
            if obs is None:
                r.eos_B[b], r.t_B[b] = True, 1  # t_B = 1: the episode ended (finished), not cut
            elif n + len(obs) >= self.T:  # no room for the observation and a turn after it
                r.eos_B[b] = True
            else:
                r.tokens_BT[b, n:n + len(obs)] = torch.tensor(obs, dtype=torch.long)
                r.len_B[b] = r.turn_start_B[b] = n + len(obs)
                chunks[b] += obs
        done_B = r.eos_B.clone()
        finished = self._leave(done_B)
        for _, rows in finished:  # finished_G: the episode ended, rather than being cut
            rows.eos_B = rows.t_B == 1
        if self.rows is None:
            return finished
        if finished:
            chunks = [chunks[b] for b in self._kept.tolist()]
        # a row whose episode is over feeds a pad, as in _decode_one
        ids_BW, mask_BW, pos_BW = _right_aligned(chunks, self.rows.pos_B.cpu(), pad=eng.pad_token_id)
        self._feed(ids_BW.to(eng.device), mask_BW.to(eng.device), pos_BW.to(eng.device))
        self._routes(*ids_BW.shape)  # not recorded under turns
        return finished

    def _leave(self, done_B: torch.Tensor) -> list[tuple[tuple[int, torch.Tensor], _Rows]]:
        """The groups whose G rows are all done, with their rows; they leave the batch and the cache
        (`self._kept`: the batch rows that stay)."""
        G, r = self.params.n, self.rows
        done_K = done_B.view(-1, G).all(dim=1)
        finished = [(self.groups[k], r[k * G:(k + 1) * G]) for k in done_K.nonzero()[:, 0].tolist()]
        if finished:  # drop the finished groups' rows from the batch and the cache
            self.groups = [g for g, done in zip(self.groups, done_K.tolist()) if not done]
            if not self.groups:
                self.rows = self.cache = self.mask_BS = None
                return finished
            self._kept = (~done_K).repeat_interleave(G).nonzero()[:, 0]
            self.rows = r[self._kept]
            self.cache.batch_select_indices(self._kept.to(self.engine.device))
            self.mask_BS = self.mask_BS[self._kept.to(self.mask_BS.device)]
            self._trim()
        return finished

    def _feed(self, ids_BW: torch.Tensor, mask_BW: torch.Tensor, pos_BW: torch.Tensor) -> None:
        """Run W new columns of every row through the model (mask 0: a row's left padding), keeping
        their KV; each row's next logits are those of its last column."""
        r = self.rows
        self.mask_BS = torch.cat([self.mask_BS, mask_BW], dim=1)
        out = self.engine.model(input_ids=ids_BW, attention_mask=self.mask_BS, position_ids=pos_BW,
                                past_key_values=self.cache, use_cache=True)
        r.logits_BV = out.logits[:, -1].float()
        r.pos_B = pos_BW[:, -1] + 1

    def _trim(self) -> None:
        """Drop leading cache columns that no live row attends to (left padding of groups gone)."""
        first = int(self.mask_BS.any(dim=0).nonzero()[0])
        if first:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            self.mask_BS = self.mask_BS[:, first:]


def _right_aligned(chunks: list[list[int]], pos_B: torch.Tensor, *, pad: int):
    """Ragged token chunks as W new columns, each row's right-aligned (mask 0 before it) at positions
    from pos_B on; an empty chunk feeds one pad (its row writes nothing: it only keeps its place)."""
    chunks = [c or [pad] for c in chunks]
    W = max(len(c) for c in chunks)
    ids_BW = torch.full((len(chunks), W), pad, dtype=torch.long)
    mask_BW = torch.zeros(len(chunks), W, dtype=torch.long)
    pos_BW = pos_B[:, None].repeat(1, W)
    for b, c in enumerate(chunks):
        ids_BW[b, W - len(c):], mask_BW[b, W - len(c):] = torch.tensor(c), 1
        pos_BW[b, W - len(c):] += torch.arange(len(c))
    return ids_BW, mask_BW, pos_BW


def _left_pad(x: torch.Tensor, length: int, *, dim: int) -> torch.Tensor:
    pad = length - x.shape[dim]
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x.new_zeros(shape), x], dim=dim)
