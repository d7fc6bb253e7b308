"""The native engine's drivers: they schedule a call's samples over its slots (tidal/executors/generator/slots.py
runs them), as nano-vllm's scheduler does beside its model runner. `NativeEngine._schedule` admits waiting prompts
into the room a driver has (`room`, `take`, `admit`) and advances it a decode step at a time (`advance`), which
hands out the groups that are done. `SingleTurnDriver`: a sample decodes until EOS, its cap or the call's budget.
`MultiTurnDriver`: a sample's turns go to the environment and come back as observations (contract.py Turns).
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Iterator

import torch

from tidal.executors.generator.contract import GroupCompletion, Resume, SamplingParams, Turns, room_for_a_turn
from tidal.executors.generator.graphs import DecodeGraphs
from tidal.executors.generator.sampling import sample_seed
from tidal.executors.generator.slots import Slots

if TYPE_CHECKING:
    from tidal.executors.generator.native_engine import NativeEngine


class Driver:
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

    def take(self, waiting: collections.deque, n: int) -> list:
        """The next (up to) n waiting prompts that may be admitted now, in order."""
        return [waiting.popleft() for _ in range(min(n, len(waiting)))]

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

    def _completion(self, index: int, *, finished_G: torch.Tensor, loss_masks: bool, cut: bool,
                    **turn_state) -> GroupCompletion:
        """A finished group copied out (outside inference mode: plain tensors for the consumer); its slots are free.
        turn_state: a cut multi-turn group's over_G and turn_starts."""
        outs = [self.slots.copy_out(s) for s in self.groups[index][1]]
        prompt, _ = self._release(index)
        lengths = [len(ids) for ids, _, _ in outs]
        return GroupCompletion(index=index, prompt_ids_P=prompt.clone(), response_ids=[ids for ids, _, _ in outs],
                               logprobs=[logp for _, logp, _ in outs], finished_G=finished_G,
                               loss_masks=[mask for _, _, mask in outs] if loss_masks else None, cut=cut,
                               routing=self.routing.group(index, lengths), **turn_state)


class SingleTurnDriver(Driver):
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
            written = [(res.response_ids[j], res.logprobs[j], bool(res.finished_G[j]), None) for j in range(self.G)]
            self.slots.start(slots, seeds=[sample_seed(run_seed=p.seed, step=res.step, prompt_index=res.index,
                                                       sample_index=j) for j in range(self.G)],
                             stop=[self._stop_at(ids.numel()) for ids, _, _, _ in written], written=written)
            decode += [s for s, (_, _, ended, _) in zip(slots, written) if not ended]
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


class MultiTurnDriver(Driver):
    """The samples of a multi-turn rollout. A sample whose turn ends stops decoding and the turn goes to the
    environment (Turns.submit, answered on the rollout's pool); it keeps its slot and KV, and the group's place
    in the batch counts as free while none of its samples decodes. When the answer comes back (Turns.ready) the
    sample feeds its turn's last token and the observation in one forward with the others' tokens. A sample
    whose episode is over stops for good; its group is handed out when all G are. With model.numerics=exact a
    sample's tokens and log-probs do not depend on the samples around it or when its answer returns.

    With a `budget` (partial rollouts) a sample that has sampled `budget` tokens in this call stops where it is:
    within a turn, or after its turn's answer was written (the observation is not fed). A group whose samples
    are all over or stopped so comes back `cut`, with each sample's state (over_G, turn_starts); a later call
    resumes it (`Resume`) by prefilling the prompt and every response token with that call's weights, and the
    sample samples on, in the same turn or the next. Where a sample is cut depends on token counts alone."""

    def __init__(self, engine: NativeEngine, params: SamplingParams, step: int, turns: Turns, slots: Slots,
                 budget: int | None, unopened: set[int]):
        super().__init__(engine, params, step, slots)
        self.turns, self.T, self.budget = turns, turns.max_total_tokens, budget
        self.unopened, self.openings = set(unopened), {}  # prompts whose environments are not ready; the ready ones
        self.routing.start(whole_single_turn=False, max_new_tokens=params.max_new_tokens)
        self.away: dict[tuple[int, int], tuple[int, int]] = {}  # (index, sample) -> (slot, its turn's last token)
        self.over: dict[int, dict[int, bool]] = {}  # per group, its samples whose episode is over: finished or cut
        self.cut: dict[int, set[int]] = {}  # per group, its samples stopped at the call's budget
        self.turn_start: dict[int, int] = {}  # slot -> where its current turn began in its response
        self.length: dict[int, int] = {}  # slot -> tokens in its response
        self.sampled: dict[int, int] = {}  # slot -> tokens it wrote in this call (the budget's count)

    def room(self) -> int:
        busy = len({self.keys[s][0] for s in self.decoding})
        return min(self.engine.max_batch_prompts - busy, len(self.slots.free) // self.G)

    def take(self, waiting: collections.deque, n: int) -> list:
        """The next (up to) n waiting prompts whose environments are ready (their first observation appended): the
        engine decodes those admitted while the others' are made and reset; with nothing to decode, it waits for one."""
        if not self.unopened:
            return super().take(waiting, n)
        idle = not self.decoding and not self.away
        self.openings.update(self.turns.opened(wait_s=0.05 if idle else 0.0))
        out, kept = [], collections.deque()
        while waiting:
            index, prompt, resume = waiting.popleft()
            if len(out) == n or (index in self.unopened and index not in self.openings):
                kept.append((index, prompt, resume))
                continue
            if index in self.unopened:
                self.unopened.discard(index)
                prompt = torch.cat([prompt, torch.tensor(self.openings.pop(index), dtype=torch.long)])
            out.append((index, prompt, resume))
        waiting.extend(kept)
        return out

    def admit(self, prompts: list[tuple[int, torch.Tensor, Resume | None]]) -> None:
        fresh = [(i, p) for i, p, resume in prompts if resume is None]
        new = self._admit_fresh(fresh, stop=self.T) if fresh else []
        for i, _ in fresh:
            self.over[i], self.cut[i] = {}, set()
        self.turn_start.update({s: 0 for s in new})
        self.length.update({s: 0 for s in new})
        self.sampled.update({s: 0 for s in new})
        resumed = [(i, p, resume) for i, p, resume in prompts if resume is not None]
        if resumed:
            new += self._admit_resumed(resumed)
        self._decode_from(self.decoding + new)

    @torch.inference_mode()
    def _admit_resumed(self, prompts: list[tuple[int, torch.Tensor, Resume]]) -> list[int]:
        """A cut group's samples take their responses so far (tokens, log-probs, which tokens were sampled); each
        one whose episode goes on prefills its prompt and response and samples its next token. Returns those."""
        p, decode, chunks = self.params, [], []
        for i, prompt, res in prompts:
            slots = self._hold(i, prompt)
            over_G = res.finished_G if res.over_G is None else res.over_G
            self.over[i] = {j: bool(res.finished_G[j]) for j in range(self.G) if over_G[j]}
            self.cut[i] = set()
            self.slots.start(slots, seeds=[sample_seed(run_seed=p.seed, step=res.step, prompt_index=res.index,
                                                       sample_index=j) for j in range(self.G)],
                             stop=[self.T] * self.G,
                             written=[(res.response_ids[j], res.logprobs[j], bool(over_G[j]), res.loss_masks[j])
                                      for j in range(self.G)])
            for j, s in enumerate(slots):
                self.length[s], self.turn_start[s], self.sampled[s] = len(res.response_ids[j]), res.turn_starts[j], 0
                if not over_G[j]:
                    decode.append(s)
                    chunks.append(torch.cat([prompt, res.response_ids[j]]))
        if decode:
            self.slots.sample(self.slots.rows_of(decode), self.slots.forward(decode, chunks))
        return decode

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
        for index in [i for i, over in self.over.items() if len(over) + len(self.cut[i]) == self.G]:
            over, cut = self.over.pop(index), self.cut.pop(index)
            finished_G = torch.tensor([over.get(j, False) for j in range(self.G)])
            state = {}
            if cut:  # what a later call resumes it from
                state = {"over_G": torch.tensor([j in over for j in range(self.G)]),
                         "turn_starts": [self.turn_start[s] for s in self.groups[index][1]]}
            yield self._completion(index, finished_G=finished_G, loss_masks=True, cut=bool(cut), **state)

    def _spent(self, s: int) -> bool:
        """The slot has written the call's budget of tokens (partial rollouts): it stops until a later call."""
        return self.budget is not None and self.sampled[s] >= self.budget

    def _write(self, chunks: dict[int, list[int]]) -> None:
        """Every decoding sample writes its token; one whose turn ended (EOS, or the turn's cap) goes to the
        environment, one that reached the response's budget is over (cut: finished stays False), one that spent the
        call's budget stops within its turn."""
        with torch.inference_mode():
            self.slots.write(self.rows_B)
            tok_B = self.slots.next_tok_N[self.rows_B].tolist()
        for s, tok in zip(self.decoding, tok_B):
            index, sample = self.keys[s]
            self.length[s] = n = self.length[s] + 1
            self.sampled[s] += 1
            ended = tok == self.engine.eos_token_id
            if not ended and n - self.turn_start[s] < self.turns.max_tokens(index=index, sample=sample):
                if n == self.T:  # a turn that never ends is cut at the budget
                    self.over[index][sample] = False
                elif self._spent(s):
                    self.cut[index].add(sample)
                else:
                    chunks[s] = [tok]
                continue
            self.turns.submit(index=index, sample=sample, turn_ids=self.slots.tokens_NT[s, self.turn_start[s]:n].cpu(),
                              ended=ended)
            self.away[(index, sample)] = (s, tok)

    def _answered(self, key: tuple[int, int], obs: list[int] | None, chunks: dict[int, list[int]]) -> None:
        """The environment's answer to a sample's turn: its episode is over, or the observation is written into its
        response and fed with the turn's last token (or, the call's budget spent, left for a later call to feed)."""
        s, last = self.away.pop(key)
        n = self.length[s]
        if obs is None or not room_for_a_turn(used=n, observation=len(obs), total=self.T):
            self.over[key[0]][key[1]] = obs is None  # finished: the episode ended, rather than being cut
            return
        with torch.inference_mode():
            self.slots.observe(s, obs)
        self.length[s] = self.turn_start[s] = n + len(obs)
        if self._spent(s):
            self.cut[key[0]].add(key[1])
            return
        chunks[s] = [last] + obs
