"""The generator executor: samples G responses per prompt and streams finished groups out."""
from __future__ import annotations

import time
from dataclasses import dataclass

from channels.payloads import GroupVerdict, RolloutGroup, WeightsUpdate
from executors.base import Executor, ExecutorEnv, StepContext, unit_aborted
from executors.embedded.task import embedded_prompts, held_out_prompts
from executors.generator.config import DataConfig, EvalConfig, GeneratorConfig, ModelConfig
from executors.generator.data import PromptRow, PromptSet, load_prompts
from executors.generator.engine import NativeEngine, PromptRequest, SamplingParams


@dataclass(frozen=True)
class GeneratorMetrics:
    """The generator's per-step record in metrics.jsonl."""

    gen_s: float
    gen_tokens_per_s: float
    gen_start_t: float  # wall clock: generation of the step started (its weights had arrived)
    gen_end_t: float
    prompts_generated: int  # B, plus the top-ups of dynamic sampling
    sampling_rounds: int
    eval_gen_s: float | None = None  # generating the held-out prompts' responses (evaluation steps only)


EVAL_SEED = 0x5EED_E7A1


class Generator(Executor):
    inputs = {"weights": WeightsUpdate}
    outputs = {"rollouts": RolloutGroup}

    def __init__(self, *, name: str = "generator", config: GeneratorConfig, model: ModelConfig,
                 data: DataConfig, dynamic_sampling: bool = False, max_rounds: int = 16,
                 evaluation: EvalConfig | None = None):
        """`dynamic_sampling`: after each round, wait for the reward's verdicts and sample
        B - kept more prompts (indices B, B+1, ...) with the same weights, until B groups are kept.
        `evaluation` (every > 0): on evaluation steps, after the step's rollouts, sample the held-out
        prompts with the same weights and send them on the `eval` output."""
        super().__init__(name=name, units=config.replicas, ranks_per_unit=config.tp)
        self.cfg, self.model_cfg, self.data_cfg = config, model, data
        self.dynamic, self.max_rounds = dynamic_sampling, max_rounds
        self.eval_cfg = evaluation if evaluation is not None and evaluation.every > 0 else None
        if dynamic_sampling:
            self.inputs = {**self.inputs, "verdicts": GroupVerdict}
        if self.eval_cfg:
            self.outputs = {**self.outputs, "eval": RolloutGroup}

    def describe(self):
        return {"replicas": self.cfg.replicas, "tp": self.cfg.tp, "G": self.cfg.samples_per_prompt,
                "engine": self.cfg.engine}

    def init(self, env: ExecutorEnv) -> None:
        super().init(env)
        # model code (transformers, DTensor, vLLM) loads here, on the generator's ranks: building a
        # graph (the CLI, --dry-run) stays light
        from executors.hf import load_tokenizer

        self.tokenizer = load_tokenizer(self.model_cfg.path)
        # the engine, and the WEIGHTS channel's view of it: {name: spec} and {name: local shard}
        self.engine, self.specs, self.shards = {"native": self._native, "vllm": self._vllm}[self.cfg.engine](env)
        rows = (load_prompts(self.data_cfg.path, self.data_cfg.columns) if self.data_cfg.path else
                [PromptRow(prompt=r["prompt"], extras={"answer": r["answer"]})
                 for r in embedded_prompts(self.data_cfg.embedded_prompts, seed=env.seed)])
        self.prompts = PromptSet(rows, tokenizer=self.tokenizer, max_prompt_tokens=self.data_cfg.max_prompt_tokens,
                                 apply_chat_template=self.data_cfg.chat_template)
        if self.prompts.dropped and env.is_leader:
            print(f"tidal: {self.prompts.dropped} of {len(rows)} prompts are longer than "
                  f"max_prompt_tokens={self.data_cfg.max_prompt_tokens} and were dropped", flush=True)
        self.params = SamplingParams(n=self.cfg.samples_per_prompt, max_new_tokens=self.cfg.max_new_tokens,
                                     seed=env.seed, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                     top_k=self.cfg.top_k)
        if self.eval_cfg:
            self._init_eval(env)

    def _init_eval(self, env: ExecutorEnv) -> None:
        e = self.eval_cfg
        rows = (load_prompts(e.path, self.data_cfg.columns)[:e.prompts] if e.path else
                [PromptRow(prompt=r["prompt"], extras={"answer": r["answer"]})
                 for r in held_out_prompts(e.prompts, seed=env.seed, train=self.data_cfg.embedded_prompts)])
        self.eval_prompts = PromptSet(rows, tokenizer=self.tokenizer, max_prompt_tokens=self.data_cfg.max_prompt_tokens,
                                      apply_chat_template=self.data_cfg.chat_template)
        if self.eval_prompts.dropped and env.is_leader:
            print(f"tidal: {self.eval_prompts.dropped} of {len(rows)} evaluation prompts are longer than "
                  f"max_prompt_tokens={self.data_cfg.max_prompt_tokens} and were dropped", flush=True)
        # its own noise stream (the seed of a sample is a hash of run seed, step, index, sample)
        self.eval_params = SamplingParams(n=e.samples, max_new_tokens=e.max_new_tokens or self.cfg.max_new_tokens,
                                          seed=env.seed ^ EVAL_SEED, temperature=e.temperature,
                                          top_p=self.cfg.top_p, top_k=self.cfg.top_k)

    def _native(self, env: ExecutorEnv):
        from executors.hf import load_model
        from executors.parallel import apply_tp, build_mesh, local_shards, param_specs

        # same seed as the trainer's init, so step 0 samples with exactly the trainer's weights; a
        # resumed run starts from the checkpoint's, which the trainer saved at the step before
        model = load_model(self.weights_path, dtype=self.model_cfg.torch_dtype, seed=env.seed).to(env.device)
        if self.cfg.tp > 1:
            # a replica's tp ranks decode in lockstep: the lm_head all-gathers the logits, so each
            # samples the same tokens from the same per-sample seeds; its first rank sends the groups
            mesh = build_mesh(ranks=env.ranks, tp=self.cfg.tp, device_type=env.device.type, parent=env.group)
            apply_tp(model, mesh=mesh["tp"])
        engine = NativeEngine(model, eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
                              max_batch_prompts=self.cfg.max_batch_prompts, admission=self.cfg.admission)
        return engine, param_specs(model), local_shards(model)  # pushes land in the model itself

    def _vllm(self, env: ExecutorEnv):
        from executors.generator.vllm_engine import VllmEngine, engine_model_dir, receive_buffers

        tp_rank = env.units[env.unit_index].index(env.rank)
        with engine_model_dir(self.weights_path, seed=env.seed, tokenizer=self.tokenizer) as model_dir:
            specs, shards = receive_buffers(model_dir, dtype=self.model_cfg.torch_dtype, tp=self.cfg.tp,
                                            tp_rank=tp_rank, device=env.device)
            engine = VllmEngine(
                model_dir=model_dir, ranks=env.ranks, tp=self.cfg.tp, tp_rank=tp_rank,
                dtype=self.model_cfg.dtype, eos_token_id=self.tokenizer.eos_token_id, seed=env.seed,
                max_model_len=self.cfg.vllm.max_model_len or self.data_cfg.max_prompt_tokens + max(
                    self.cfg.max_new_tokens, (self.eval_cfg.max_new_tokens or 0) if self.eval_cfg else 0),
                config=self.cfg.vllm, device_type=env.device.type)
        if env.is_leader:
            print(f"tidal: vLLM engine ready in {engine.init_s:.1f} s", flush=True)
        return engine, specs, shards

    @property
    def weights_path(self) -> str | None:
        """The weights of the first step: the model's, or a resumed run's checkpoint (an HF directory)."""
        return str(self.env.resume) if self.env.resume else self.model_cfg.path

    def step(self, ctx: StepContext):
        with ctx.timeline.span("weights_recv"):
            received = ctx.inbound["weights"].receive_into(self.shards, self.specs)  # shard by shard
        if received:
            with ctx.timeline.span("weights_load"):
                self.engine.load_weights(self.shards, self.specs)
        t0, start_t = time.perf_counter(), time.time()
        B = self.data_cfg.prompts_per_step
        indices, kept, next_index, rounds, tokens = list(range(B)), 0, B, 0, 0
        verdicts = iter(ctx.inbound["verdicts"]) if self.dynamic else None
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
        gen_s, gen_end_t, eval_s = time.perf_counter() - t0, time.time(), None
        if self.eval_cfg and ctx.step % self.eval_cfg.every == 0 and not self._stop_now():
            # the step's rollouts are complete: end their stream first, so the reward and the trainer
            # finish the step while the held-out prompts are sampled with the same weights
            ctx.outbound["rollouts"].close_step()
            t0 = time.perf_counter()
            with ctx.timeline.span("eval"):
                self._evaluate(ctx)
            eval_s = time.perf_counter() - t0
        return GeneratorMetrics(gen_s=gen_s, gen_tokens_per_s=tokens / max(gen_s, 1e-9), gen_start_t=start_t,
                                gen_end_t=gen_end_t, prompts_generated=next_index, sampling_rounds=rounds + 1,
                                eval_gen_s=eval_s)

    def finalize(self, output_dir) -> None:
        self.engine.close()

    def _evaluate(self, ctx: StepContext) -> None:
        """This replica's share of the held-out prompts (index i: replica i % replicas), all of them."""
        mine = [i for i in range(len(self.eval_prompts)) if i % self.units == self.env.unit_index]
        rows = {i: self.eval_prompts.at(i) for i in mine}
        requests = [PromptRequest(index=i, prompt_ids=ids) for i, (_, ids) in rows.items()]
        for done in self.engine.generate(requests, self.eval_params, step=ctx.step):
            row = rows[done.index][0]
            ctx.outbound["eval"].send(RolloutGroup(
                step=ctx.step, index=done.index, prompt=row.prompt, extras=row.extras, prompt_ids=done.prompt_ids_P,
                responses=done.response_ids, logprobs=done.logprobs, finished=done.finished_G, data_row=row.line))

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
        rows = {i: row for i, row, _ in mine}
        requests = [PromptRequest(index=i, prompt_ids=ids) for i, _, ids in mine]
        out, tokens = ctx.outbound["rollouts"], 0
        for done in self.engine.generate(requests, self.params, step=ctx.step, stop=self._stop_now):
            group = RolloutGroup(step=ctx.step, index=done.index, prompt=rows[done.index].prompt,
                                 extras=rows[done.index].extras, prompt_ids=done.prompt_ids_P,
                                 responses=done.response_ids, logprobs=done.logprobs, finished=done.finished_G,
                                 data_row=rows[done.index].line)
            tokens += sum(r.numel() for r in done.response_ids)
            ctx.timeline.mark("generated", index=done.index)
            out.send(group)
        return tokens
