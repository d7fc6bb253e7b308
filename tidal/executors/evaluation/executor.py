"""Evaluation on held-out prompts: a phase of the step, run by two guest executors.

    eval_sampler   on the generator's ranks, after its step: the held-out prompts, sampled with the
                   weights the step's rollouts were sampled with (the generator's engine)
    eval           on the reward's ranks, after its step: scored with the reward's functions into
                   eval/* metrics and eval_samples.jsonl

Each runs once its host's outputs are closed, so the reward and the trainer finish the step's
training while the held-out prompts are sampled. Neither knows the other's code: the held-out groups
travel on their own channel, and each uses its host only through the host's public methods
(`Generator.sample`/`sampling`, `Reward.score`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tidal.channels.payloads import RolloutGroup
from tidal.common.files import append_jsonl
from tidal.executors.base import Executor, ExecutorEnv, Input, Output, StepContext, unit_aborted
from tidal.executors.data import PromptSet, load_prompts
from tidal.modeling.tiny.task import held_out_prompts
from tidal.executors.evaluation.config import EvalConfig
from tidal.executors.generator.config import DataConfig

EVAL_SEED = 0x5EED_E7A1  # the held-out samples' own noise stream: xor-ed into the run seed


@dataclass(frozen=True)
class EvalSamplerMetrics:
    gen_s: float  # sampling the held-out prompts' responses


@dataclass(frozen=True)
class EvalMetrics:
    """The evaluation's record (eval/<field> in metrics.jsonl), over every reward replica."""

    reward_mean: float
    pass_at_1: float  # the chance that one sample solves its prompt: solved / k per prompt, averaged
    pass_at_k: float  # share of prompts at least one of whose k samples solves it
    k: int
    response_len_mean: float
    finished_frac: float
    prompts: int

    def as_metrics(self) -> dict:
        """The names metrics.jsonl has always used: pass@1, and pass@k for k > 1."""
        out = {"reward_mean": self.reward_mean, "pass@1": self.pass_at_1,
               "response_len_mean": self.response_len_mean, "finished_frac": self.finished_frac,
               "prompts": self.prompts}
        if self.k > 1:
            out[f"pass@{self.k}"] = self.pass_at_k
        return out


def is_eval_step(cfg: EvalConfig, step: int) -> bool:
    return cfg.every > 0 and step % cfg.every == 0


class EvalSampler(Executor):
    """Samples the held-out prompts on its host generator's ranks (index i: replica i % replicas)."""

    held_out = Output(RolloutGroup)
    needs_device = False  # it samples with its host's engine, on the host's device

    def __init__(self, *, name: str = "eval_sampler", host: Executor, config: EvalConfig, data: DataConfig,
                 max_new_tokens: int):
        """max_new_tokens: the generator's, when config.max_new_tokens is None."""
        super().__init__(name=name, host=host)
        self.cfg, self.data_cfg = config, data
        self.max_new_tokens = config.max_new_tokens or max_new_tokens

    def describe(self):
        return {"every": self.cfg.every, "prompts": self.cfg.prompts, "k": self.cfg.samples}

    def init(self, env: ExecutorEnv) -> None:
        super().init(env)
        e, generator = self.cfg, self.host
        rows = (load_prompts(e.path, self.data_cfg.columns)[:e.prompts] if e.path else
                [generator.embedded_row(r)
                 for r in held_out_prompts(e.prompts, seed=env.seed, train=self.data_cfg.embedded_prompts)])
        self.prompts = PromptSet(rows, tokenizer=generator.tokenizer, max_prompt_tokens=self.data_cfg.max_prompt_tokens,
                                 apply_chat_template=self.data_cfg.chat_template, tools=generator.rollout.tools)
        if self.prompts.dropped and env.is_leader:
            print(f"tidal: {self.prompts.dropped} of {len(rows)} evaluation prompts are longer than "
                  f"max_prompt_tokens={self.data_cfg.max_prompt_tokens} and were dropped", flush=True)
        self.params = generator.sampling(n=e.samples, max_new_tokens=self.max_new_tokens, seed=env.seed ^ EVAL_SEED,
                                         temperature=e.temperature)

    def step(self, ctx: StepContext) -> EvalSamplerMetrics | None:
        if not is_eval_step(self.cfg, ctx.step) or unit_aborted(self.env):
            return None
        t0 = time.perf_counter()
        replicas, mine = len(self.env.units), self.env.unit_index
        prompts = [(i, *self.prompts.at(i)) for i in range(len(self.prompts)) if i % replicas == mine]
        self.host.wake(ctx)  # co-located: the generator released the device after its step
        with ctx.timeline.span("eval"):
            for group in self.host.sample(prompts, self.params, step=ctx.step):
                ctx.outbound[self.held_out].send(group)
        self.host.release(ctx)
        return EvalSamplerMetrics(gen_s=time.perf_counter() - t0)


class EvalScorer(Executor):
    """Scores the held-out groups on its host reward's ranks; the leader reports the whole set."""

    held_out = Input(RolloutGroup)
    needs_device = False  # its host's rule functions, on the CPU

    def __init__(self, *, name: str = "eval", host: Executor, config: EvalConfig):
        super().__init__(name=name, host=host)
        self.cfg = config

    def describe(self):
        return {"pass_threshold": self.cfg.pass_threshold}

    def step(self, ctx: StepContext) -> EvalMetrics | None:
        G = self.cfg.samples
        # reward sum, samples, length sum, finished, pass@1 sum, pass@k sum, prompts (float64: exact counts)
        sums_7 = torch.zeros(7, dtype=torch.float64)
        rows = []
        for group in ctx.inbound[self.held_out]:
            with ctx.timeline.span("eval_scored", index=group.index):
                texts, total_G, parts, _ = self.host.score(group)
            solved = int((total_G >= self.cfg.pass_threshold).sum())
            lengths = [r.numel() for r in group.responses]
            sums_7 += torch.tensor([total_G.double().sum().item(), G, sum(lengths), int(group.finished.sum()),
                                    solved / G, float(solved > 0), 1], dtype=torch.float64)
            rows += [{"step": group.step, "prompt_index": group.index, "sample": j, "prompt": group.prompt,
                      "response": texts[j], "reward": float(total_G[j]), "rewards": {k: v[j] for k, v in parts.items()},
                      "length": lengths[j], "finished": bool(group.finished[j])} for j in range(G)]
        if not is_eval_step(self.cfg, ctx.step):
            return None
        append_jsonl(self.env.output_dir / "eval_samples.jsonl", sorted(rows, key=lambda r: (r["prompt_index"], r["sample"])))
        if len(self.env.units) > 1:  # each replica scored a share
            sums_7 = sums_7.to(self.env.device)
            dist.all_reduce(sums_7, group=self.env.group)
            sums_7 = sums_7.cpu()
        reward, n, length, finished, pass1, passk, prompts = sums_7.tolist()
        return EvalMetrics(reward_mean=reward / max(n, 1), pass_at_1=pass1 / max(prompts, 1),
                           pass_at_k=passk / max(prompts, 1), k=G, response_len_mean=length / max(n, 1),
                           finished_frac=finished / max(n, 1), prompts=int(prompts))
