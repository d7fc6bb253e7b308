"""The generator executor: samples G responses per prompt and streams finished groups out."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from tidal.channels.payloads import GroupVerdict, RolloutGroup, WeightsUpdate
from tidal.executors.base import Executor, ExecutorEnv, Input, Output, StepContext, unit_aborted
from tidal.executors.data import PromptRow, PromptSet, load_prompts
from tidal.modeling.tiny.task import embedded_prompts
from tidal.executors.generator.config import DataConfig, GeneratorConfig, ModelConfig, MultiTurnConfig
from tidal.executors.generator.contract import EngineSpec, SamplingParams
from tidal.executors.generator.engines import ENGINES
from tidal.executors.generator.partial import PartialRollouts
from tidal.executors.generator.rollouts import ROLLOUTS
from tidal.modeling.lora import LoraConfig


@dataclass(frozen=True)
class GeneratorMetrics:
    """The generator's per-step record in metrics.jsonl."""

    gen_s: float
    gen_tokens_per_s: float
    gen_start_t: float  # wall clock: generation of the step started (its weights had arrived)
    gen_end_t: float
    prompts_generated: int  # B, plus the top-ups of dynamic sampling
    sampling_rounds: int
    turns_mean: float  # model turns per sample (1 in a single-turn rollout)
    env_s: float  # time in the environment's calls (multi-turn), summed over samples (calls overlap: multi_turn.env_workers)
    env_wait_s: float  # of gen_s, the time the engine waited for the environment with no sample to decode
    env_errors: int  # samples an environment failed in (multi_turn.on_error=zero: scored 0)
    # partial rollouts (generator.partial_rollout_tokens): groups cut at the step's token budget and
    # left for the next step, and groups cut before that this step resumed (finished or cut again)
    partial_groups: int
    resumed_groups: int


class Generator(Executor):
    weights = Input(WeightsUpdate)  # the trainer's push at the previous step's barrier
    verdicts = Input(GroupVerdict, optional=True)  # dynamic sampling: which groups the reward kept
    rollouts = Output(RolloutGroup)

    def __init__(self, *, name: str = "generator", config: GeneratorConfig, model: ModelConfig,
                 data: DataConfig, rollout: str = "single_turn", multi_turn: MultiTurnConfig | None = None,
                 dynamic_sampling: bool = False, max_rounds: int = 16, longest_response: int = 0,
                 lora: LoraConfig | None = None):
        """`dynamic_sampling`: after each round, wait for the reward's verdicts and sample
        B - kept more prompts (indices B, B+1, ...) with the same weights, until B groups are kept.
        `longest_response`: the longest response a guest samples with this engine (an evaluation's
        may exceed config.max_new_tokens; vLLM sizes its context for it). `lora`: the trainer's
        adapters, which this generator holds too (the pushes carry them alone; tidal/modeling/lora.py)."""
        super().__init__(name=name, units=config.replicas, ranks_per_unit=config.tp)
        self.cfg, self.model_cfg, self.data_cfg = config, model, data
        self.dynamic, self.max_rounds = dynamic_sampling, max_rounds
        self.rollout_cls, self.multi_turn = ROLLOUTS.get(rollout), multi_turn or MultiTurnConfig()
        self.rollout_name = rollout
        self.lora = lora or LoraConfig()
        self.longest_response = max(longest_response, self.rollout_cls.response_tokens(self.multi_turn,
                                                                                       config.max_new_tokens))

    def needs(self, port) -> bool:
        return port is Generator.verdicts and self.dynamic or super().needs(port)

    def describe(self):
        return {"replicas": self.cfg.replicas, "tp": self.cfg.tp, "G": self.cfg.samples_per_prompt,
                "engine": self.cfg.engine, "rollout": self.rollout_name}

    def init(self, env: ExecutorEnv) -> None:
        super().init(env)
        # model code (transformers, DTensor, vLLM) loads here, on the generator's ranks: building a
        # graph (the CLI, --dry-run) stays light
        from tidal.modeling.hf import load_tokenizer

        self.tokenizer = load_tokenizer(self.model_cfg.path)
        # the engine, and the WEIGHTS channel's view of it: {name: spec} and {name: local shard}
        self.rollout = self.rollout_cls(tokenizer=self.tokenizer, config=self.multi_turn,
                                        max_new_tokens=self.cfg.max_new_tokens,
                                        max_prompt_tokens=self.data_cfg.max_prompt_tokens)
        self.engine, self.specs, self.shards = ENGINES.get(self.cfg.engine).build(self._engine_spec(env))
        self._released = False  # time-shared: the engine gave its memory back (release), until wake
        rows = (load_prompts(self.data_cfg.path, self.data_cfg.columns) if self.data_cfg.path else
                [self.embedded_row(r) for r in embedded_prompts(self.data_cfg.embedded_prompts, seed=env.seed)])
        self.prompts = PromptSet(rows, tokenizer=self.tokenizer, max_prompt_tokens=self.data_cfg.max_prompt_tokens,
                                 apply_chat_template=self.data_cfg.chat_template, tools=self.rollout.tools)
        if self.rollout_name == "multi_turn" and env.is_leader:  # the record says how a code tool is isolated
            from tidal.executors.environments.base import isolation_note

            if note := isolation_note(self.multi_turn.env or "lookup"):
                print(f"tidal: {note}", flush=True)
        if self.prompts.dropped and env.is_leader:
            print(f"tidal: {self.prompts.dropped} of {len(rows)} prompts are longer than "
                  f"max_prompt_tokens={self.data_cfg.max_prompt_tokens} and were dropped", flush=True)
        self.policy_version: int | None = None  # set at this attempt's first step (see `step`)
        self.params = SamplingParams(n=self.cfg.samples_per_prompt, max_new_tokens=self.cfg.max_new_tokens,
                                     seed=env.seed, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                     top_k=self.cfg.top_k)
        self.partial = None
        if self.cfg.partial_rollout_tokens is not None:
            self.partial = PartialRollouts(rollout=self.rollout, unit=env.unit_index, units=self.units,
                                           prompts_per_step=self.data_cfg.prompts_per_step,
                                           budget=self.cfg.partial_rollout_tokens)
            if env.resume is not None:
                self.partial.load(env.resume / "generator", prompt_of=self._prompt_of)

    def _engine_spec(self, env: ExecutorEnv) -> EngineSpec:
        lora = self.lora if self.lora.on else None
        # with LoRA the engine holds the model's base, and a resumed run's checkpoint the adapters alone
        return EngineSpec(weights=self.model_cfg.path if lora else self.weights_path,
                          adapter=self.weights_path if lora and self.resumes_weights else None, lora=lora,
                          dtype=self.model_cfg.torch_dtype, tokenizer=self.tokenizer,
                          max_tokens=self.data_cfg.max_prompt_tokens + self.longest_response, config=self.cfg,
                          device=env.device, ranks=env.ranks, unit=env.units[env.unit_index], rank=env.rank,
                          group=env.group, seed=env.seed, time_shared=env.time_shared, leader=env.is_leader,
                          numerics=self.model_cfg.numerics)

    def embedded_row(self, row: dict) -> PromptRow:
        """An embedded-task prompt as this generator's rollout poses it (also an evaluation's way to it)."""
        row = self.rollout.embedded(row)
        return PromptRow(prompt=row["prompt"], extras={k: v for k, v in row.items() if k != "prompt"})

    def _prompt_of(self, step: int, index: int):
        ((_, row, ids),) = self.prompts.prompts(step, [index], batch_size=self.data_cfg.prompts_per_step,
                                                 seed=self.env.seed, max_topups=0)
        return row, ids

    @property
    def resumes_weights(self) -> bool:
        """The first step samples with a resumed run's checkpoint, not the model's weights."""
        return self.env.weights_from is not None

    @property
    def weights_path(self) -> str | None:
        """The weights of the first step: the model's, or a resumed run's checkpoint (an HF directory)."""
        return str(self.env.weights_from) if self.resumes_weights else self.model_cfg.path

    def step(self, ctx: StepContext):
        self.wake(ctx)
        pushes = ctx.inbound[self.weights]
        with ctx.timeline.span("weights_recv"):
            received = pushes.receive_into(self.shards, self.specs)  # shard by shard
        if received:  # the weights step `pushes.step`'s barrier made (step k is trained by version k)
            self.policy_version = pushes.step + 1
        elif self.policy_version is None:  # the run's start weights: the model's, or the checkpoint of step - 1
            self.policy_version = ctx.step if self.resumes_weights else 0
        if received:
            with ctx.timeline.span("weights_load"):
                self.engine.load_weights(self.shards, self.specs)
        t0, start_t, waited = time.perf_counter(), time.time(), self.rollout.env_wait_s
        B = self.data_cfg.prompts_per_step
        indices, kept, next_index, rounds, tokens = list(range(B)), 0, B, 0, 0
        self.episodes = []  # this step's multi-turn episodes, for the metrics
        verdicts = iter(ctx.inbound[self.verdicts]) if self.dynamic else None
        with ctx.timeline.span("generate"):
            while True:
                tokens += self._generate(ctx, indices)
                if not self.dynamic or self._stop_now():  # a stop: no top-up round
                    break
                # dynamic sampling: every replica hears every verdict, so all agree on the top-up
                kept += sum(next(verdicts).kept for _ in indices)
                if kept == B:
                    break
                rounds += 1
                if rounds > self.max_rounds:
                    raise ValueError(f"dynamic sampling: after {rounds} rounds only {kept} of {B} groups of "
                                     f"step {ctx.step} have reward variance; the batch cannot be filled")
                indices = list(range(next_index, next_index + B - kept))
                next_index += B - kept
        gen_s = time.perf_counter() - t0
        errors = [e["error"] for e in self.episodes if e["error"] is not None]
        if errors and self.env.rank == self.env.units[self.env.unit_index][0]:  # once per replica
            print(f"tidal: warning: {len(errors)} samples ended by an environment error at step {ctx.step} "
                  f"(scored 0, multi_turn.on_error=zero); the first: {errors[0]}", flush=True)
        cut, resumed = self._partial_counts(ctx.step)
        self.release(ctx)
        return GeneratorMetrics(gen_s=gen_s, gen_tokens_per_s=tokens / max(gen_s, 1e-9), gen_start_t=start_t,
                                gen_end_t=time.time(), prompts_generated=next_index, sampling_rounds=rounds + 1,
                                turns_mean=(sum(e["turns"] for e in self.episodes) / len(self.episodes)
                                            if self.episodes else 1.0),
                                env_s=sum(e["env_s"] for e in self.episodes), env_errors=len(errors),
                                env_wait_s=self.rollout.env_wait_s - waited,
                                partial_groups=cut, resumed_groups=resumed)

    def _partial_counts(self, step: int) -> tuple[int, int]:
        """Partial rollouts: end the step (its cut groups wait for the next), and count the groups
        cut and resumed by every replica (each keeps its own): one small all-reduce over the
        generator's ranks, made only where partial rollouts are on and there are several replicas."""
        if self.partial is None:
            return 0, 0
        self.partial.end(step)
        counts = [len(self.partial.carried), self.partial.resumed]
        if self.units > 1:
            first = self.env.rank == self.env.units[self.env.unit_index][0]
            counts_2 = torch.tensor(counts if first else [0, 0], device=self.env.device)
            dist.all_reduce(counts_2, group=self.env.group)
            counts = counts_2.tolist()
        return counts[0], counts[1]

    def save_checkpoint(self, path, *, step: int) -> None:
        """Partial rollouts: the groups cut by step `step` (each replica's first rank writes its own)."""
        if self.partial is not None and self.env.rank == self.env.units[self.env.unit_index][0]:
            self.partial.save(path / "generator", step=step)

    def finalize(self, output_dir) -> None:
        self.engine.close()

    def _stop_now(self) -> bool:
        """Asked before each decode iteration; a unit's ranks decode in lockstep, so they agree."""
        return unit_aborted(self.env)

    def _generate(self, ctx: StepContext, indices: list[int]) -> int:
        """Sample this replica's share of `indices` and send each group the moment it is done."""
        # only this replica's share; top-ups (index >= B) come from the step's own range, at most
        # B per round over max_rounds rounds, so they never take a later step's prompts
        B = self.data_cfg.prompts_per_step
        mine = self.prompts.prompts(ctx.step, [i for i in indices if i % self.units == self.env.unit_index],
                                    batch_size=B, seed=self.env.seed, max_topups=B * self.max_rounds)
        if self.partial is not None:  # partial rollouts: the keeper runs the step (its cut groups first)
            groups = self.partial.run(self.engine, mine, self.params, step=ctx.step, stop=self._stop_now,
                                      version=self.policy_version)
        else:
            groups = self.rollout.run(self.engine, mine, self.params, step=ctx.step, stop=self._stop_now)
        out, tokens = ctx.outbound[self.rollouts], 0
        for group in groups:
            tokens += sum(group.model_tokens(i) for i in range(len(group.responses)))
            self.episodes += group.episodes or []
            ctx.timeline.mark("generated", index=group.index)
            group.policy_version = self.policy_version
            out.send(group)
        # partial rollouts: what the step wrote, in the groups it ended and in those it cut
        return self.partial.written_tokens if self.partial is not None else tokens

    def sample(self, prompts: list[tuple[int, PromptRow, list[int]]], params: SamplingParams, *,
               step: int) -> Iterator[RolloutGroup]:
        """Each (index, row, token ids) prompt's group, the moment its samples are done, with the
        weights of this step (also a guest's way to this engine, e.g. an evaluation's: it wakes the
        engine first, and releases it after)."""
        return self.rollout.run(self.engine, prompts, params, step=step, stop=self._stop_now)

    # ---- time-sharing the device (placement=colocated) ---------------------------------------------
    def wake(self, ctx: StepContext) -> None:
        """Take the device back (the trainer offloaded its state at its barrier): the `onload` span."""
        if self.env.time_shared and self._released:
            with ctx.timeline.span("onload"):
                self.engine.wake()
            self._released = False

    def release(self, ctx: StepContext) -> None:
        """Give the device to the trainer, which trains next on it: the `offload` span."""
        if self.env.time_shared and not self._released:
            with ctx.timeline.span("offload"):
                self.engine.release()
            self._released = True

    def sampling(self, *, n: int, max_new_tokens: int, seed: int, temperature: float) -> SamplingParams:
        """Sampling parameters for a guest: the generator's top-p and top-k, its own n, length, noise and temperature."""
        return SamplingParams(n=n, max_new_tokens=max_new_tokens, seed=seed, temperature=temperature,
                              top_p=self.cfg.top_p, top_k=self.cfg.top_k)
