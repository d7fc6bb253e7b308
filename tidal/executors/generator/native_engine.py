"""The native generation engine: batched decoding over any HF causal LM, every sample in a fixed slot.

Shaped like vLLM's offline API (SamplingParams, one request per prompt, n samples each) so the
generator executor can swap engines. Two properties matter more than speed here:

* Per-sample randomness: each token is drawn by sampling.py from its sample's seed and position, so a
  sample does not depend on batching, chunking, or on how prompts are split over generator ranks.
* Streaming: a prompt group is yielded as soon as its G samples are finished.

Layout (tidal/executors/generator/slots.py runs it, drivers.py schedules): every sample has a slot, its KV
written in place in a store allocated once per call (tidal/modeling/slot_attention.py); up to `max_batch_prompts`
groups hold slots at once. A prompt is prefilled once and its KV copied into its G slots. A sample that ends
stops decoding at once; its group's slots go to the next prompt when all G have ended. Multi-turn
(MultiTurnDriver): a sample whose turn ends keeps its slot and KV while the environment answers off the decode
loop, and feeds the observation when it comes back. Admission: `chunked` starts the next max_batch_prompts
prompts when the whole batch is done; `continuous` gives a freed group's slots to the next prompt at once.
Continuous keeps the batch full (fewer, fuller forwards: what a device whose decode step costs the same for
8 rows as for 64 wants); on CPU a forward's cost follows its rows (bench/admission.py), with the same samples.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from tidal.executors.generator.contract import GroupCompletion, PromptRequest, SamplingParams, Turns
from tidal.executors.generator.config import ADMISSIONS, DEFAULT_ADMISSION
from tidal.executors.generator.drivers import Driver, MultiTurnDriver, SingleTurnDriver
from tidal.executors.generator.graphs import DecodeGraphs
from tidal.executors.generator.routing import NO_ROUTING, recorder_for
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
        assert budget is None or budget >= 1
        prompts = [torch.as_tensor(r.prompt_ids, dtype=torch.long).reshape(-1).cpu() for r in requests]
        if any(p.numel() == 0 for p in prompts):
            raise ValueError("empty prompt")
        waiting = [(r.index, p, r.resume) for r, p in zip(requests, prompts)]
        if not waiting:
            return iter(())
        unopened = {r.index for r in requests if r.opening}
        assert turns is not None or not unopened, "a request waits for its environments without turns"
        # the slots: every group the admission may hold at once, each sample as long as its prompt and response (with
        # graphs in multiples of 128, so that the next call, whose prompts differ, finds the same store); a prompt
        # that waits for its first observation may grow to max_prompt_tokens
        response = params.max_new_tokens if turns is None else turns.max_total_tokens
        length = max(turns.max_prompt_tokens if r.opening else p.numel() for r, p in zip(requests, prompts)) + response
        graphs = self.graphs and turns is None
        if graphs:
            length = -(-length // 128) * 128
        # multi-turn: waiting samples keep their slots, so room for as many groups again (admission waits for slots)
        groups = min(len(waiting), self.max_batch_prompts * (1 if turns is None else 2))
        for setting, tokens in self._kv_budgets():
            groups = min(groups, _budgeted_groups(setting, tokens, samples=params.n, length=length))
        slots, decode_graphs = self._slots(params, groups=groups, length=length, response=response, graphs=graphs)
        return self._stream(waiting, params, step, stop, turns, budget, slots, decode_graphs, unopened)  # validated now

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

    def _stream(self, waiting, params, step, stop, turns, budget, slots, decode_graphs,
                unopened) -> Iterator[GroupCompletion]:
        if turns is None:
            driver = SingleTurnDriver(self, params, step, budget, slots, decode_graphs)
        else:
            driver = MultiTurnDriver(self, params, step, turns, slots, budget, unopened)
        try:
            yield from self._schedule(driver, collections.deque(waiting), stop)
        finally:
            driver.slots.busy = False  # kept slots may serve the next call
        if turns is not None and stop():
            turns.abandon()  # the environment calls in flight are dropped with the step

    def _schedule(self, driver: Driver, waiting: collections.deque,
                  stop: Callable[[], bool]) -> Iterator[GroupCompletion]:
        while (waiting or driver.live) and not stop():
            # continuous: a finished group's slots take the next prompt at once (under turns, so may a group whose
            # samples all wait for the environment); chunked: the next max_batch_prompts prompts start when the
            # whole batch is done
            free = driver.room()
            if waiting and free > 0 and (self.admission == "continuous" or not driver.live):
                if admitted := driver.take(waiting, free):
                    driver.admit(admitted)
            # Yield outside inference_mode: the caller (a trainer in the same thread) runs between
            # yields and must not inherit it; the yielded tensors are plain copies.
            yield from driver.advance()


def _budgeted_groups(setting: str, tokens: int, *, samples: int, length: int) -> int:
    """The groups whose slots fit a budget of `tokens` KV positions (refused where not one group fits)."""
    groups = tokens // (samples * length)
    if groups < 1:
        raise ValueError(f"{setting} holds no group: one group is {samples} samples x {length} positions (its longest "
                         f"prompt and response) = {samples * length}")
    return groups
