"""The native generation engine: batched decoding over any HF causal LM, every sample in a fixed slot.

Shaped like vLLM's offline API (SamplingParams, one request per prompt, n samples each) so the
generator executor can swap engines. Two properties matter more than speed here:

* Per-sample randomness: each token is drawn by sampling.py from its sample's seed and position, so a
  sample does not depend on batching, chunking, or on how prompts are split over generator ranks.
* Streaming: a prompt group is yielded as soon as its G samples are finished.

Layout (tidal/executors/generator/slots.py runs it, the drivers here schedule): every sample has a slot, its KV
written in place in a store allocated once per call (tidal/modeling/slot_attention.py); up to `max_batch_prompts`
groups hold slots at once. A prompt is prefilled once and its KV copied into its G slots. A sample that ends
stops decoding at once; its group's slots go to the next prompt when all G have ended. Multi-turn
(_MultiTurn): a sample whose turn ends keeps its slot and KV while the environment answers off the decode
loop, and feeds the observation when it comes back. Admission: `chunked` starts the next max_batch_prompts
prompts when the whole batch is done; `continuous` gives a freed group's slots to the next prompt at once.
Continuous keeps the batch full (fewer, fuller forwards: what a device whose decode step costs the same for
8 rows as for 64 wants); on CPU a forward's cost follows its rows (bench/admission.py), with the same samples.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from tidal.executors.generator.contract import (GroupCompletion, PromptRequest, Resume, SamplingParams, Turns,
                                          room_for_a_turn)
from tidal.executors.generator.graphs import DecodeGraphs
from tidal.executors.generator.config import ADMISSIONS, DEFAULT_ADMISSION
from tidal.executors.generator.routing import NO_ROUTING, recorder_for
from tidal.executors.generator.sampling import sample_seed
from tidal.executors.generator.slots import Slots, free_memory_bytes, kv_bytes_per_position

if TYPE_CHECKING:  # transformers loads with the first chunk: building a graph stays light
    import transformers


class NativeEngine:
    def __init__(self, model: transformers.PreTrainedModel, *, eos_token_id: int, pad_token_id: int,
                 max_batch_prompts: int = 16, admission: str = DEFAULT_ADMISSION, routing=None, numerics: str = "default",
                 check_every: int | None = None, graphs: bool | None = None, kv_budget_tokens: int | None = None,
                 kv_memory_fraction: float | None = None):
        """routing: the recorder of an MoE model's routing (tidal/executors/generator/routing.py); None: the
        model's own (recorder_for), NO_ROUTING for a dense one. numerics: "exact" runs the model's products
        and attention batch-invariant (tidal/modeling/numerics.py), as the trainer does under model.numerics=exact.
        check_every: decode steps between the host's reads of which samples ended (single-turn): on a CPU a
        read costs nothing and 1 hands a group out the step it ends; on an accelerator each read waits for the
        device, so it reads every 8th step (an ended sample feeds pads until then; the samples are the same).
        graphs: decode single-turn steps in batch-size buckets (tidal/executors/generator/graphs.py), captured as CUDA
        graphs on a CUDA device where the step can be (default numerics, no routing record); None: on CUDA.
        kv_budget_tokens: the most KV positions (slots x their length) a call's store may hold: fewer groups decode
        at once, and admission waits for their slots (generator.kv_budget_tokens). kv_memory_fraction: the store
        may take at most this fraction of the memory free at the engine's first call (generator.kv_memory_fraction)."""
        if max_batch_prompts < 1:
            raise ValueError(f"max_batch_prompts must be >= 1, got {max_batch_prompts}")
        if check_every is not None and check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        self.model = model.eval()
        # a bf16 model's logits in float32 (tidal/modeling/head.py), as the trainer computes them; its attention is the
        # slots' while it decodes (tidal/modeling/slot_attention.py: in float32 on a CPU, as the trainer's)
        from tidal.modeling.attention import install as install_attention
        from tidal.modeling.head import Fp32Head  # DTensor: loaded on the generator's ranks only

        self._fp32_head = Fp32Head.install(model)
        self.exact = numerics == "exact"
        # exact: its linear layers; its attention is the slots' (exact items) while it decodes
        install_attention(model, numerics=numerics, packed=False)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        # an MoE model records the experts each token was routed to, for the trainer to replay
        self.routing = routing if routing is not None else recorder_for(model)
        self.max_batch_prompts = max_batch_prompts
        self.admission = admission
        self.check_every = check_every or (1 if self.device.type == "cpu" else 8)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.kv_budget_tokens, self.kv_memory_fraction = kv_budget_tokens, kv_memory_fraction
        self._memory_budget: tuple[str, int] | None = None  # kv_memory_fraction's, read at the first call
        self._kept: tuple[tuple, Slots, DecodeGraphs] | None = None  # with graphs: the slots a call leaves

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def load_weights(self, shards, specs) -> None:
        """The WEIGHTS channel received straight into this engine's parameters, except where it handed
        over the trainer's own tensor (placement=colocated, tidal/channels/push.py): a parameter then takes
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
        """The KV cache lives within a `generate` call, but with graphs the engine keeps the last call's slots
        (their captured steps): dropped here, so the executors that time-share this device can allocate it."""
        self._kept = None

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
        dropped: a stop request abandons the step, tidal/common/stop.py). `turns`: a multi-turn rollout's
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
        if not waiting:
            return iter(())
        # the slots: every group the admission may hold at once, each sample as long as its prompt and response (with
        # graphs in multiples of 128, so that the next call, whose prompts differ, finds the same store)
        response = params.max_new_tokens if turns is None else turns.max_total_tokens
        length = max(p.numel() for p in prompts) + response
        graphs = self.graphs and turns is None
        if graphs:
            length = -(-length // 128) * 128
        # multi-turn: waiting samples keep their slots, so room for as many groups again (admission waits for slots)
        groups = min(len(waiting), self.max_batch_prompts * (1 if turns is None else 2))
        for setting, tokens in self._kv_budgets():
            groups = min(groups, _budgeted_groups(setting, tokens, samples=params.n, length=length))
        slots, decode_graphs = self._slots(params, groups=groups, length=length, response=response, graphs=graphs)
        return self._stream(waiting, params, step, stop, turns, budget, slots, decode_graphs)  # validated now

    def _kv_budgets(self) -> list[tuple[str, int]]:
        """(the setting, the KV positions it allows) of each budget the store keeps within. The memory's is read
        once, at the first call: a later call would find the store its predecessor kept (graphs) taken, not free."""
        out = [] if self.kv_budget_tokens is None else [(f"generator.kv_budget_tokens={self.kv_budget_tokens}",
                                                         self.kv_budget_tokens)]
        if self.kv_memory_fraction is not None and self._memory_budget is None:
            free = free_memory_bytes(self.device)  # None: it cannot be read, no bound
            tokens = -1 if free is None else int(self.kv_memory_fraction * free) // kv_bytes_per_position(self.model)
            self._memory_budget = (f"generator.kv_memory_fraction={self.kv_memory_fraction} of the "
                                   f"{(free or 0) / 2 ** 30:.2f} GiB free ({tokens} positions)", tokens)
        if self._memory_budget is not None and self._memory_budget[1] >= 0:
            out.append(self._memory_budget)
        return out

    def _slots(self, params: SamplingParams, *, groups: int, length: int, response: int,
               graphs: bool) -> tuple[Slots, DecodeGraphs | None]:
        """A call's slots: fresh ones, or with graphs the ones the last call left where their shape and sampling are
        the same and no other stream holds them, so their captured steps replay."""
        if not graphs:
            return Slots(self, params, slots=groups * params.n, length=length, response=response), None
        key = (groups * params.n, length, response, params.temperature, params.top_p, params.top_k)
        if self._kept is None or self._kept[0] != key or self._kept[1].busy:
            slots = Slots(self, params, slots=groups * params.n, length=length, response=response)
            capture = self.device.type == "cuda" and not self.exact and self.routing is NO_ROUTING
            self._kept = (key, slots, DecodeGraphs(slots, capture=capture))
        _, slots, decode_graphs = self._kept
        slots.reset(params)
        return slots, decode_graphs

    def _stream(self, waiting, params, step, stop, turns, budget, slots, decode_graphs) -> Iterator[GroupCompletion]:
        if turns is None:
            driver = _Single(self, params, step, budget, slots, decode_graphs)
        else:
            driver = _MultiTurn(self, params, step, turns, slots)
        try:
            yield from self._schedule(driver, collections.deque(waiting), stop)
        finally:
            driver.slots.busy = False  # kept slots may serve the next call
        if turns is not None and stop():
            turns.abandon()  # the environment calls in flight are dropped with the step

    def _schedule(self, driver: "_Driver", waiting: collections.deque,
                  stop: Callable[[], bool]) -> Iterator[GroupCompletion]:
        while (waiting or driver.live) and not stop():
            # continuous: a finished group's slots take the next prompt at once (under turns, so may a group whose
            # samples all wait for the environment); chunked: the next max_batch_prompts prompts start when the
            # whole batch is done
            free = driver.room()
            if waiting and free > 0 and (self.admission == "continuous" or not driver.live):
                driver.admit([waiting.popleft() for _ in range(min(free, len(waiting)))])
            # Yield outside inference_mode: the caller (a trainer in the same thread) runs between
            # yields and must not inherit it; the yielded tensors are plain copies.
            yield from driver.advance()


class _Driver:
    """What both drivers share: the slots, the groups that hold them (in admission order) and a fresh group's
    admission (its prompt prefilled once, its KV shared by its G samples)."""

    def __init__(self, engine: NativeEngine, params: SamplingParams, step: int, slots: Slots):
        self.engine, self.params, self.step, self.G = engine, params, step, params.n
        self.slots = slots
        self.groups: dict[int, tuple[torch.Tensor, list[int]]] = {}  # prompt index -> (prompt ids, its G slots)
        self.keys: dict[int, tuple[int, int]] = {}  # slot -> (prompt index, sample)
        self.decoding: list[int] = []  # the slots that decode, in order
        self._rows_B: torch.Tensor | None = None
        self.routing = engine.routing

    @property
    def live(self) -> int:
        """Groups admitted and not yet handed out."""
        return len(self.groups)

    @property
    def rows_B(self) -> torch.Tensor:
        """The decoding slots as a device tensor, made again only when they change."""
        if self._rows_B is None:
            self._rows_B = torch.tensor(self.decoding, dtype=torch.long, device=self.engine.device)
        return self._rows_B

    def _decode_from(self, slots: list[int]) -> None:
        self.decoding = sorted(slots)
        self._rows_B = None

    def _hold(self, index: int, prompt: torch.Tensor) -> list[int]:
        slots = self.slots.take(self.G)
        self.groups[index] = (prompt, slots)
        self.keys.update({s: (index, j) for j, s in enumerate(slots)})
        return slots

    def _release(self, index: int) -> tuple[torch.Tensor, list[int]]:
        prompt, slots = self.groups.pop(index)
        for s in slots:
            del self.keys[s]
        self.slots.give_back(slots)
        return prompt, slots

    @torch.inference_mode()
    def _admit_fresh(self, prompts: list[tuple[int, torch.Tensor]], *, stop: int) -> list[int]:
        """Prefill the new prompts together, once each, and give each prompt's G slots its KV; every sample
        draws its first token from the prompt's logits. Returns the slots."""
        G, p = self.G, self.params
        held = [self._hold(i, prompt) for i, prompt in prompts]
        flat = [s for slots in held for s in slots]
        self.slots.start(flat, seeds=[sample_seed(run_seed=p.seed, step=self.step, prompt_index=i, sample_index=j)
                                      for i, _ in prompts for j in range(G)], stop=[stop] * len(flat))
        logits_CV = self.slots.forward([slots[0] for slots in held], [prompt for _, prompt in prompts])
        self.routing.prefilled([(i, len(prompt)) for i, prompt in prompts],
                               width=max(len(prompt) for _, prompt in prompts), samples=G)
        if G > 1:
            self.slots.share([slots[0] for slots in held for _ in range(G - 1)], [s for slots in held for s in slots[1:]],
                             columns=max(len(prompt) for _, prompt in prompts))
        self.slots.sample(self.slots.rows_of(flat), logits_CV.repeat_interleave(G, dim=0))
        return flat

    def _completion(self, index: int, *, finished_G: torch.Tensor, loss_masks: bool, cut: bool) -> GroupCompletion:
        """A finished group copied out (outside inference mode: plain tensors for the consumer); its slots are free."""
        outs = [self.slots.copy_out(s) for s in self.groups[index][1]]
        prompt, _ = self._release(index)
        lengths = [len(ids) for ids, _, _ in outs]
        return GroupCompletion(index=index, prompt_ids_P=prompt.clone(), response_ids=[ids for ids, _, _ in outs],
                               logprobs=[logp for _, logp, _ in outs], finished_G=finished_G,
                               loss_masks=[mask for _, _, mask in outs] if loss_masks else None, cut=cut,
                               routing=self.routing.group(index, lengths))


class _Single(_Driver):
    """Single-turn groups: each sample decodes until EOS, max_new_tokens or the call's budget (partial rollouts:
    a group whose samples have not all ended by then comes back `cut`)."""

    def __init__(self, engine: NativeEngine, params: SamplingParams, step: int, budget: int | None, slots: Slots,
                 graphs: DecodeGraphs | None):
        super().__init__(engine, params, step, slots)
        self.budget, self.steps, self.graphs = budget, 0, graphs
        self.routing.start(whole_single_turn=budget is None, max_new_tokens=params.max_new_tokens)

    def room(self) -> int:
        return min(self.engine.max_batch_prompts - len(self.groups), len(self.slots.free) // self.G)

    def _stop_at(self, t: int) -> int:
        return self.params.max_new_tokens if self.budget is None else min(t + self.budget, self.params.max_new_tokens)

    def admit(self, prompts: list[tuple[int, torch.Tensor, Resume | None]]) -> None:
        fresh = [(i, p) for i, p, resume in prompts if resume is None]
        resumed = [(i, p, resume) for i, p, resume in prompts if resume is not None]
        new = self._admit_fresh(fresh, stop=self._stop_at(0)) if fresh else []
        if resumed:
            new += self._admit_resumed(resumed)
        self._decode_from(self.decoding + new)

    @torch.inference_mode()
    def _admit_resumed(self, prompts: list[tuple[int, torch.Tensor, Resume]]) -> list[int]:
        """A resumed group's samples take their tokens so far; each unfinished one prefills its prompt and them
        (the weights have changed since they were written: the trainer scores every token with its step's), an
        ended one writes nothing more. Returns the slots that decode."""
        p, decode = self.params, []
        for i, prompt, res in prompts:
            slots = self._hold(i, prompt)
            written = [(res.response_ids[j], res.logprobs[j], bool(res.finished_G[j])) for j in range(self.G)]
            self.slots.start(slots, seeds=[sample_seed(run_seed=p.seed, step=res.step, prompt_index=res.index,
                                                       sample_index=j) for j in range(self.G)],
                             stop=[self._stop_at(ids.numel()) for ids, _, _ in written], written=written)
            decode += [s for s, (_, _, ended) in zip(slots, written) if not ended]
        if decode:
            resumes = {i: res for i, _, res in prompts}
            chunks = [torch.cat([self.groups[i][0], resumes[i].response_ids[j]]) for i, j in map(self.keys.get, decode)]
            self.slots.sample(self.slots.rows_of(decode), self.slots.forward(decode, chunks))
        return decode

    def advance(self) -> Iterator[GroupCompletion]:
        """Write every decoding sample's token, hand out the groups that just finished, feed the rest."""
        if self.decoding:
            with torch.inference_mode():
                ended_B = self.slots.write(self.rows_B)
            self.steps += 1
            if self.steps % self.engine.check_every == 0:
                ended = ended_B.tolist()  # the host's one read (every check_every steps)
                if any(ended):
                    self._decode_from([s for s, e in zip(self.decoding, ended) if not e])
        decoding = set(self.decoding)
        for index in [i for i, (_, slots) in self.groups.items() if not decoding.intersection(slots)]:
            slots = self.groups[index][1]
            eos_G = self.slots.eos_N[slots].cpu()
            len_G = self.slots.len_N[slots].cpu()
            cut = self.budget is not None and bool((~eos_G & (len_G < self.params.max_new_tokens)).any())
            yield self._completion(index, finished_G=eos_G.clone(), loss_masks=False, cut=cut)
        if self.decoding:
            with torch.inference_mode():
                fed_B = (self.graphs.decode(self.decoding) if self.graphs is not None else
                         self.slots.decode(self.decoding, self.rows_B))
                # a row that fed its newest token: that token's experts
                self.routing.decoded([self.keys[s] for s in self.decoding], fed_B=fed_B,
                                     t_B=self.slots.len_N[self.rows_B])


class _MultiTurn(_Driver):
    """The samples of a multi-turn rollout. A sample whose turn ends stops decoding and the turn goes to the
    environment (Turns.submit, answered on the rollout's pool); it keeps its slot and KV, and the group's place
    in the batch counts as free while none of its samples decodes. When the answer comes back (Turns.ready) the
    sample feeds its turn's last token and the observation in one forward with the others' tokens. A sample
    whose episode is over stops for good; its group is handed out when all G are. With model.numerics=exact a
    sample's tokens and log-probs do not depend on the samples around it or when its answer returns."""

    def __init__(self, engine: NativeEngine, params: SamplingParams, step: int, turns: Turns, slots: Slots):
        super().__init__(engine, params, step, slots)
        self.turns, self.T = turns, turns.max_total_tokens
        self.routing.start(whole_single_turn=False, max_new_tokens=params.max_new_tokens)
        self.away: dict[tuple[int, int], tuple[int, int]] = {}  # (index, sample) -> (slot, its turn's last token)
        self.over: dict[int, dict[int, bool]] = {}  # per group, its samples whose episode is over: finished or cut
        self.turn_start: dict[int, int] = {}  # slot -> where its current turn began in its response
        self.length: dict[int, int] = {}  # slot -> tokens in its response

    def room(self) -> int:
        busy = len({self.keys[s][0] for s in self.decoding})
        return min(self.engine.max_batch_prompts - busy, len(self.slots.free) // self.G)

    def admit(self, prompts: list[tuple[int, torch.Tensor, Resume | None]]) -> None:
        assert all(resume is None for _, _, resume in prompts), "partial rollouts are single-turn"
        new = self._admit_fresh([(i, p) for i, p, _ in prompts], stop=self.T)
        for i, _, _ in prompts:
            self.over[i] = {}
        self.turn_start.update({s: 0 for s in new})
        self.length.update({s: 0 for s in new})
        self._decode_from(self.decoding + new)

    def advance(self) -> Iterator[GroupCompletion]:
        chunks: dict[int, list[int]] = {}  # what each decoding slot feeds next
        if self.decoding:
            self._write(chunks)
        if self.away:  # with no sample left to decode, wait for an answer (briefly: the caller asks stop() between)
            for index, sample, obs in self.turns.ready(wait_s=0.05 if not self.decoding else 0.0):
                self._answered((index, sample), obs, chunks)
        self._decode_from(list(chunks))
        if chunks:
            with torch.inference_mode():
                logits_BV = self.slots.forward(self.decoding, [chunks[s] for s in self.decoding])
                self.slots.sample(self.rows_B, logits_BV)
        for index in [i for i, over in self.over.items() if len(over) == self.G]:
            over = self.over.pop(index)
            finished_G = torch.tensor([over[j] for j in range(self.G)])
            yield self._completion(index, finished_G=finished_G, loss_masks=True, cut=False)

    def _write(self, chunks: dict[int, list[int]]) -> None:
        """Every decoding sample writes its token; one whose turn ended (EOS, or the turn's cap) goes to the
        environment, one that reached the response's budget is over (cut: finished stays False)."""
        with torch.inference_mode():
            self.slots.write(self.rows_B)
            tok_B = self.slots.next_tok_N[self.rows_B].tolist()
        for s, tok in zip(self.decoding, tok_B):
            index, sample = self.keys[s]
            self.length[s] = n = self.length[s] + 1
            ended = tok == self.engine.eos_token_id
            if not ended and n - self.turn_start[s] < self.turns.max_tokens(index=index, sample=sample):
                if n == self.T:  # a turn that never ends is cut at the budget
                    self.over[index][sample] = False
                else:
                    chunks[s] = [tok]
                continue
            self.turns.submit(index=index, sample=sample, turn_ids=self.slots.tokens_NT[s, self.turn_start[s]:n].cpu(),
                              ended=ended)
            self.away[(index, sample)] = (s, tok)

    def _answered(self, key: tuple[int, int], obs: list[int] | None, chunks: dict[int, list[int]]) -> None:
        """The environment's answer to a sample's turn: its episode is over, or the observation is written into its
        response and fed with the turn's last token."""
        s, last = self.away.pop(key)
        n = self.length[s]
        if obs is None or not room_for_a_turn(used=n, observation=len(obs), total=self.T):
            self.over[key[0]][key[1]] = obs is None  # finished: the episode ended, rather than being cut
            return
        with torch.inference_mode():
            self.slots.observe(s, obs)
        self.length[s] = self.turn_start[s] = n + len(obs)
        chunks[s] = [last] + obs


def _budgeted_groups(setting: str, tokens: int, *, samples: int, length: int) -> int:
    """The groups whose slots fit a budget of `tokens` KV positions (refused where not one group fits)."""
    groups = tokens // (samples * length)
    if groups < 1:
        raise ValueError(f"{setting} holds no group: one group is {samples} samples x {length} positions (its longest "
                         f"prompt and response) = {samples * length}")
    return groups
