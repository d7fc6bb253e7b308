"""The native generation engine: batched KV-cache decoding over any HF causal LM.

Shaped like vLLM's offline API (SamplingParams, one request per prompt, n samples each) so the
generator executor can swap engines. Two properties matter more than speed here:

* Per-sample randomness: each token is drawn by sampling.py from its sample's seed and position, so a
  sample does not depend on batching, chunking, or on how prompts are split over generator ranks.
* Streaming: a prompt group is yielded as soon as its G samples are finished.

Layout: up to `max_batch_prompts` groups decode together. A prompt is prefilled once and its KV
cache repeated G times. Finished samples stay in the batch (fed pad tokens) until their whole group
is done; then the group's rows leave the batch and cache. Multi-turn (_TurnBatch): a sample leaves
the batch when its turn ends, while the environment answers off the decode loop, and comes back with
the observation. Admission: `chunked` (the default) starts
the next max_batch_prompts prompts when the whole batch is done; `continuous` gives a freed slot to
the next prompt at once, left-padded into the running cache. Continuous keeps the batch full (fewer,
fuller forwards: what a device whose decode step costs the same for 8 rows as for 64 wants), but on
CPU a forward's cost follows its rows, and the padding makes attention longer: measured 6-8% slower
there on the default shape, 2% faster with a longer tail (bench/admission.py), with the same samples.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from executors.generator.contract import (GroupCompletion, PromptRequest, Resume, SamplingParams, Turns,
                                          room_for_a_turn)
from executors.generator.routing import recorder_for
from executors.generator.sampling import sample_seed, sample_tokens

if TYPE_CHECKING:  # transformers loads with the first chunk: building a graph stays light
    import transformers

ADMISSIONS = ("continuous", "chunked")


class NativeEngine:
    def __init__(self, model: transformers.PreTrainedModel, *, eos_token_id: int, pad_token_id: int,
                 max_batch_prompts: int = 16, admission: str = "chunked", routing=None, numerics: str = "default"):
        """routing: the recorder of an MoE model's routing (executors/generator/routing.py); None: the
        model's own (recorder_for), NO_ROUTING for a dense one. numerics: "exact" runs the model's products
        and attention batch-invariant (modeling/numerics.py), as the trainer does under model.numerics=exact."""
        if max_batch_prompts < 1:
            raise ValueError(f"max_batch_prompts must be >= 1, got {max_batch_prompts}")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        self.model = model.eval()
        # a bf16 model's logits in float32, and its attention in float32, as the trainer computes them
        # (training/head.py, training/packed_attention.py: off a packed row its attention is SDPA's)
        from modeling.head import Fp32Head  # DTensor: loaded on the generator's ranks only

        self._fp32_head = Fp32Head.install(model)
        if numerics == "exact":
            from modeling.numerics import install as install_exact

            install_exact(model)
        elif next(model.parameters()).dtype != torch.float32 and model.config._attn_implementation == "sdpa":
            from modeling.packed_attention import install

            install(model)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        # an MoE model records the experts each token was routed to, for the trainer to replay
        self.routing = routing if routing is not None else recorder_for(model)
        self.max_batch_prompts = max_batch_prompts
        self.admission = admission

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def load_weights(self, shards, specs) -> None:
        """The WEIGHTS channel received straight into this engine's parameters, except where it handed
        over the trainer's own tensor (placement=colocated, channels/push.py): a parameter then takes
        that memory as its own, so the process holds the model once (a tp-sharded one copies it into
        its shard). Then only the float32 copy of a bf16 head is stale."""
        for name, shard in shards.items():
            param = self.model.get_parameter(name)
            local = param.to_local() if hasattr(param, "to_local") else param
            if local.data_ptr() != shard.data_ptr():
                if local is param:
                    param.data = shard
                else:
                    local.copy_(shard)
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
        batch = _Batch(self, params, step, budget) if turns is None else _TurnBatch(self, params, step, turns)
        while (waiting or batch.live) and not stop():
            free = self.max_batch_prompts - batch.busy
            # continuous: a finished group's slot takes the next prompt at once (under turns, so does the
            # slot of a group whose samples all wait for the environment); chunked: the next
            # max_batch_prompts prompts start when the whole batch is done
            if waiting and free > 0 and (self.admission == "continuous" or not batch.live):
                batch.admit([waiting.popleft() for _ in range(min(free, len(waiting)))])
            # Yield outside inference_mode: the caller (a trainer in the same thread) runs between
            # yields and must not inherit it; the yielded tensors are plain clones.
            yield from batch.advance()
        if turns is not None and stop():
            turns.abandon()  # the environment calls in flight are dropped with the step


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

    def _tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def __getitem__(self, rows) -> "_Rows":
        """Rows by a slice (views) or an index tensor (copies), each on its own device."""
        return _Rows(*(x[rows if isinstance(rows, slice) else rows.to(x.device)] for x in self._tensors()))

    def cat(self, other: "_Rows") -> "_Rows":
        return _Rows.join([self, other])

    @staticmethod
    def join(parts: list["_Rows"]) -> "_Rows":
        return _Rows(*(torch.cat(column) for column in zip(*(p._tensors() for p in parts))))


class _Batch:
    """The decode batch: G rows per live group, groups in admission order (batch row b is sample
    b % G of group b // G); everything a row has written lives in the batch too, so one step is the
    same few tensor ops for any number of groups. Every row's newest token sits in the last cache
    column; rows admitted later are left-padded (mask 0) to the batch's length, and columns no live
    row attends to are dropped as groups leave."""

    turns = None

    def __init__(self, engine: NativeEngine, params: SamplingParams, step: int, budget: int | None = None):
        self.engine, self.params, self.step = engine, params, step
        self.T = self._response_tokens()
        self.budget = budget
        self.routing = engine.routing
        self.routing.start(whole_single_turn=self.turns is None and budget is None, max_new_tokens=params.max_new_tokens)
        self.groups: list[tuple[int, torch.Tensor]] = []  # (prompt index, prompt ids) per group in the batch
        self.rows: _Rows | None = None
        self.cache = self.mask_BS = None

    def _response_tokens(self) -> int:
        return self.params.max_new_tokens

    @property
    def live(self) -> int:
        """Groups admitted and not yet handed out."""
        return len(self.groups)

    @property
    def busy(self) -> int:
        """Groups holding a decode slot (max_batch_prompts)."""
        return len(self.groups)

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
        """Prefill the sequences left-padded together: (cache, mask, last logits)."""
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
        return cache, mask_CP.to(dev), out.logits[:, -1].float()

    def _new_rows(self, R: int, **given) -> _Rows:
        eng, T = self.engine, self.T
        empty = dict(t_B=torch.zeros(R, dtype=torch.long), len_B=torch.zeros(R, dtype=torch.long),
                     eos_B=torch.zeros(R, dtype=torch.bool), tokens_BT=torch.full((R, T), eng.pad_token_id, dtype=torch.long),
                     logp_BT=torch.zeros(R, T), sampled_BT=torch.zeros(R, T, dtype=torch.bool),
                     turn_start_B=torch.zeros(R, dtype=torch.long), stop_B=torch.full((R,), self._stop_at(0)))
        return _Rows(**{**empty, **given})

    @torch.inference_mode()
    def _prefill_fresh(self, prompts: list[tuple[int, torch.Tensor]]):
        """Prefill the new prompts together, once each, and give each of its G samples a copy of its
        cache rows; they join the batch with their first logits."""
        G, dev = self.params.n, self.engine.device
        cache, mask_CP, logits_CV = self._prefill([p for _, p in prompts])
        self.routing.prefilled([(i, len(p)) for i, p in prompts], width=mask_CP.shape[1], samples=G)
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
        cache, mask_CP, _ = self._prefill([p for _, p, _ in prompts])
        cache.batch_repeat_interleave(G)
        samples = [(p, res, j) for _, p, res in prompts for j in range(G)]
        chunks = [[] if bool(res.finished_G[j]) else res.response_ids[j].tolist() for _, res, j in samples]
        ids_BW, mask_BW, pos_BW = _right_aligned(chunks, torch.tensor([len(p) for p, _, _ in samples]),
                                                 pad=eng.pad_token_id)
        mask_BS = torch.cat([mask_CP.repeat_interleave(G, dim=0), mask_BW.to(dev)], dim=1)
        out = eng.model(input_ids=ids_BW.to(dev), attention_mask=mask_BS, position_ids=pos_BW.to(dev),
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
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
        """New groups' rows and their cache join the batch."""
        self._append(cache, mask_BS, rows)
        self.groups += groups

    def _append(self, cache, mask_BS: torch.Tensor, rows: _Rows) -> None:
        """Rows and their cache join the batch behind the live ones, left-padded to one length."""
        if self.rows is None:
            self.cache, self.mask_BS, self.rows = cache, mask_BS, rows
            return
        S = max(self.mask_BS.shape[1], mask_BS.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, S, dim=2), _left_pad(theirs.keys, S, dim=2)])
            mine.values = torch.cat([_left_pad(mine.values, S, dim=2), _left_pad(theirs.values, S, dim=2)])
        self.mask_BS = torch.cat([_left_pad(self.mask_BS, S, dim=1), _left_pad(mask_BS, S, dim=1)])
        self.rows = self.rows.cat(rows)

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
                                  routing=self.routing.group(index, lengths))

    @torch.inference_mode()
    def _decode_one(self) -> list[tuple[tuple[int, torch.Tensor], _Rows]]:
        """Sample the next token of every row and feed it; return the groups that finished, each
        with its G rows."""
        p, eng, r = self.params, self.engine, self.rows
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
        # a row that fed its new token (not a pad): that token's experts
        self.routing.decoded([i for i, _ in self.groups], fed_B=~done_B, t_B=self.rows.t_B)
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


class _TurnBatch(_Batch):
    """The decode batch of a multi-turn rollout. A row whose turn ends leaves the batch with its KV and
    everything it wrote, and the turn goes to the environment (Turns.submit, answered on the rollout's
    pool); the other rows decode on, and the group's slot counts as free while none of its rows
    decodes. When the answer comes back (Turns.ready) the row rejoins, left-padded into the cache, and
    feeds its turn's last token and the observation in one forward. A row whose episode is over leaves
    for good; its group is handed out when all G have. Rows are known by (prompt index, sample), not by
    place, so they may come back in any order: with model.numerics=exact a row's tokens and log-probs
    do not depend on the rows around it or when it rejoins (modeling/numerics.py)."""

    def __init__(self, engine: NativeEngine, params: SamplingParams, step: int, turns: Turns):
        self.turns = turns
        super().__init__(engine, params, step)
        self.keys: list[tuple[int, int]] = []  # (prompt index, sample) of each batch row
        self.prompts: dict[int, torch.Tensor] = {}  # the groups admitted and not handed out
        self.away: dict[tuple[int, int], _Away] = {}  # rows whose turn the environment has
        self.ended: dict[int, dict[int, _Rows]] = {}  # per group, its rows whose episode is over

    def _response_tokens(self) -> int:
        return self.turns.max_total_tokens  # every turn and observation of a sample

    @property
    def live(self) -> int:
        return len(self.prompts)

    @property
    def busy(self) -> int:
        return len({k for k, _ in self.keys})

    def _join(self, cache, mask_BS: torch.Tensor, rows: _Rows, *, groups: list[tuple[int, torch.Tensor]]) -> None:
        self._append(cache, mask_BS, rows)
        G = self.params.n
        self.keys += [(i, j) for i, _ in groups for j in range(G)]
        for i, prompt in groups:
            self.prompts[i], self.ended[i] = prompt, {}

    def advance(self) -> Iterator[GroupCompletion]:
        if self.rows is None and not self.away:
            return iter(())
        return super().advance()

    @torch.inference_mode()
    def _decode_one(self) -> list[tuple[tuple[int, torch.Tensor], _Rows]]:
        """Sample a token for every row in the batch; hand the turns that ended to the environment;
        take its answers back in; feed every row's new tokens in one forward. The uniform of a token
        is indexed by its position in the response, unique across turns."""
        chunks: dict[tuple[int, int], list[int]] = {}  # what each row feeds next
        if self.rows is not None:
            self._sample(chunks)
        back = [self._answered((k, j), obs, chunks) for k, j, obs in self._answers()]
        if back := [key for key in back if key is not None]:
            self._rejoin(back)
        if self.rows is not None:
            ids_BW, mask_BW, pos_BW = _right_aligned([chunks[key] for key in self.keys], self.rows.pos_B.cpu(),
                                                     pad=self.engine.pad_token_id)
            dev = self.engine.device
            self._feed(ids_BW.to(dev), mask_BW.to(dev), pos_BW.to(dev))
        finished = [k for k, rows in self.ended.items() if len(rows) == self.params.n]
        out = []
        for k in finished:
            rows = self.ended.pop(k)
            whole = _Rows.join([rows[j] for j in range(self.params.n)])
            whole.eos_B = whole.t_B == 1  # finished_G: the episode ended, rather than being cut
            out.append(((k, self.prompts.pop(k)), whole))
        return out

    def _answers(self) -> list[tuple[int, int, list[int] | None]]:
        """The environment's answers that are back; with no row left to decode, wait for one (briefly:
        the caller asks stop() and admits between waits)."""
        if not self.away:
            return []
        return self.turns.ready(wait_s=0.05 if self.rows is None else 0.0)

    def _sample(self, chunks: dict) -> None:
        p, eng, r = self.params, self.engine, self.rows
        tok_B, logp_B = sample_tokens(r.logits_BV, seeds_R=r.seeds_B, t=r.len_B.to(r.seeds_B.device),
                                      temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)
        tok_B, logp_B = tok_B.cpu(), logp_B.cpu()
        away, over = [], []
        for b, key in enumerate(self.keys):  # every row in the batch is writing a turn
            n = int(r.len_B[b])
            r.tokens_BT[b, n], r.logp_BT[b, n], r.sampled_BT[b, n] = tok_B[b], logp_B[b], True
            r.len_B[b] = n = n + 1
            ended = int(tok_B[b]) == eng.eos_token_id
            if not ended and n - int(r.turn_start_B[b]) < self.turns.max_tokens(index=key[0], sample=key[1]):
                if n == self.T:  # a turn that never ends is cut at the budget (finished stays False)
                    over.append(b)
                else:
                    chunks[key] = [int(tok_B[b])]
                continue
            self.turns.submit(index=key[0], sample=key[1], turn_ids=r.tokens_BT[b, int(r.turn_start_B[b]):n].clone(),
                              ended=ended)
            away.append(b)
        if away or over:
            self._part(away, over, last=tok_B)

    def _part(self, away: list[int], over: list[int], *, last: torch.Tensor) -> None:
        """Rows `away` (waiting for the environment: their KV kept) and `over` leave the batch."""
        r = self.rows
        # copied out (one gather per tensor), not views: a view would keep the whole batch's old tensors
        # alive while the row is away
        for b in over:
            self.ended[self.keys[b][0]][self.keys[b][1]] = r[torch.tensor([b])]
        if away:
            idx = torch.tensor(away)
            dev_idx = idx.to(self.engine.device)
            rows, mask = r[idx], self.mask_BS[dev_idx.to(self.mask_BS.device)]
            kv = [(layer.keys[dev_idx], layer.values[dev_idx]) for layer in self.cache.layers]
            for i, b in enumerate(away):
                self.away[self.keys[b]] = _Away(rows=rows[i:i + 1], last=int(last[b]), mask_S=mask[i:i + 1],
                                                kv=[(k[i:i + 1], v[i:i + 1]) for k, v in kv])
        gone = set(away) | set(over)
        kept = [b for b in range(len(self.keys)) if b not in gone]
        self.keys = [self.keys[b] for b in kept]
        if not kept:
            self.rows = self.cache = self.mask_BS = None
            return
        kept_B = torch.tensor(kept)
        self.rows = r[kept_B]
        self.cache.batch_select_indices(kept_B.to(self.engine.device))
        self.mask_BS = self.mask_BS[kept_B.to(self.mask_BS.device)]
        self._trim()

    def _answered(self, key: tuple[int, int], obs: list[int] | None, chunks: dict) -> tuple[int, int] | None:
        """The environment's answer to a row's turn: the row is over (None), or comes back with the
        observation (its key)."""
        away = self.away[key]
        r, n = away.rows, int(away.rows.len_B[0])
        if obs is None or not room_for_a_turn(used=n, observation=len(obs), total=self.T):  # over, or no room
            r.t_B[0] = int(obs is None)  # t_B = 1: the episode ended (finished), not cut
            self.ended[key[0]][key[1]] = r
            del self.away[key]
            return None
        r.tokens_BT[0, n:n + len(obs)] = torch.tensor(obs, dtype=torch.long)
        r.len_B[0] = r.turn_start_B[0] = n + len(obs)
        chunks[key] = [away.last] + obs
        return key

    def _rejoin(self, keys: list[tuple[int, int]]) -> None:
        """Rows back from the environment join the batch together, in one concatenation of the cache."""
        from transformers import DynamicCache

        back = [self.away.pop(key) for key in keys]
        S = max(a.mask_S.shape[1] for a in back)
        cache = DynamicCache(config=self.engine.model.config)
        for i in range(len(back[0].kv)):
            cache.update(torch.cat([_left_pad(a.kv[i][0], S, dim=2) for a in back]),
                         torch.cat([_left_pad(a.kv[i][1], S, dim=2) for a in back]), i)
        self._append(cache, torch.cat([_left_pad(a.mask_S, S, dim=1) for a in back]), _Rows.join([a.rows for a in back]))
        self.keys += keys


@dataclass
class _Away:
    """A row whose turn is with the environment: its rows, KV per layer and attention mask, set aside."""
    rows: _Rows
    last: int  # the turn's last token, fed with the observation when the row rejoins
    mask_S: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]


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
