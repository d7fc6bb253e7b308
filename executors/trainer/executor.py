"""The tri-model trainer: policy, old policy, reference, in one layout, one micro-step.

With one optimizer step per batch the old policy equals the policy during the whole step, so its
log-probs are the detached policy log-probs (no extra forward); the reference (the initial weights,
frozen) runs only when the algorithm's KL coefficient is non-zero.
Gradients accumulate per micro-batch into float64 buffers (order-independent in practice: sums of
float32 values in float64 do not round), and the batch denominator is applied once at the barrier.
"""
from __future__ import annotations

import copy
import hashlib
import math
import time
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from algorithms.base import Algorithm, AlgoConfig, LossInputs
from channels.payloads import ScoredGroup, WeightsUpdate
from executors.base import Executor, ExecutorEnv, StepContext
from executors.hf import load_model, load_tokenizer, save_hf
from executors.trainer.batching import split_group


# per-step sums, all-reduced over dp at the barrier
_SUMS = ("loss_sum", "denom", "kl_sum", "clip_sum", "tokens", "reward_sum", "reward_sq_sum", "samples",
         "len_sum", "groups", "reward_failures")


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dp: int = Field(1, ge=1, description="data-parallel trainer ranks; group i trains on rank i % dp")
    lr: float = Field(2e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from lr/(warmup+1)")
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    grad_clip: float = Field(1.0, gt=0, description="max global grad norm")
    micro_batch_size: int = Field(8, ge=1, description="sequences per micro-batch (a group splits by sample index)")
    fp64_grad_accumulation: bool = Field(True, description="accumulate grads in float64 so arrival order "
                                         "cannot change a bit; off saves memory on big models")


def lr_factor(step: int, *, warmup: int, schedule: str, total: int, floor: float) -> float:
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class Trainer(Executor):
    inputs = {"scored": ScoredGroup}
    outputs = {"weights": WeightsUpdate}

    def __init__(self, *, name: str = "trainer", config: TrainerConfig, model_path: str | None,
                 dtype: torch.dtype, algorithm: Algorithm, algo_config: AlgoConfig,
                 temperature: float, stream: bool, total_steps: int):
        super().__init__(name=name, units=config.dp)
        self.cfg, self.model_path, self.dtype = config, model_path, dtype
        self.algo, self.algo_cfg, self.temperature = algorithm, algo_config, temperature
        self.stream, self.total_steps = stream, total_steps

    def describe(self):
        return {"dp": self.cfg.dp, "algo": self.algo.name, "stream": self.stream,
                "reference": self.uses_reference}

    @property
    def uses_reference(self) -> bool:
        return getattr(self.algo_cfg, "beta", 0.0) > 0

    def init(self, env: ExecutorEnv) -> None:
        super().init(env)
        self.tokenizer = load_tokenizer(self.model_path)
        self.policy = load_model(self.model_path, dtype=self.dtype, seed=env.seed).to(env.device).train()
        self.reference = None
        if self.uses_reference:
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=self.cfg.lr, betas=self.cfg.betas,
                                     weight_decay=self.cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(
            s, warmup=self.cfg.warmup_steps, schedule=self.cfg.lr_schedule, total=self.total_steps,
            floor=self.cfg.min_lr_ratio))
        acc_dtype = torch.float64 if self.cfg.fp64_grad_accumulation else None
        self.acc = [torch.zeros_like(p, dtype=acc_dtype or p.dtype) for p in self.params]

    # ---- one step -------------------------------------------------------------------------
    def step(self, ctx: StepContext):
        sums = torch.zeros(len(_SUMS), dtype=torch.float64)
        mismatch = torch.zeros((), dtype=torch.float64)  # max |trainer logp - sampling logp|
        digests: dict[int, str] = {}
        train_s = 0.0
        groups = ctx.inbound["scored"] if self.stream else list(ctx.inbound["scored"])
        for group in groups:
            t0 = time.perf_counter()
            with ctx.timeline.span("train", index=group.index):
                group_sums, group_mismatch = self._train_group(group)
            sums += group_sums
            mismatch = torch.maximum(mismatch, group_mismatch)
            digests[group.index] = _group_digest(group)
            train_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        with ctx.timeline.span("barrier"):
            sums, mismatch, digest, grad_norm = self._barrier(sums, mismatch, digests)
        train_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        with ctx.timeline.span("push"):
            ctx.outbound["weights"].push(self.policy.named_parameters())
            ctx.outbound["weights"].flush()
        push_s = time.perf_counter() - t0
        metrics = {k: v for k, v in zip(_SUMS, sums.tolist())}
        return self._metrics(metrics, mismatch.item(), digest, grad_norm, train_s=train_s, push_s=push_s)

    def _train_group(self, group: ScoredGroup) -> tuple[torch.Tensor, torch.Tensor]:
        adv_G = self.algo.advantages(group.rewards, self.algo_cfg)
        sums = dict.fromkeys(_SUMS, 0.0)
        mismatch = torch.zeros((), dtype=torch.float64)
        for mb in split_group(group.prompt_ids, group.responses, micro_batch_size=self.cfg.micro_batch_size,
                              pad_id=self.tokenizer.pad_token_id, device=self.env.device):
            logp_NT = mb.logprobs(self.policy, temperature=self.temperature)
            ref_NT = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_NT = mb.logprobs(self.reference, temperature=self.temperature)
            idx = list(mb.samples)
            out = self.algo.loss(LossInputs(logp_NT=logp_NT, old_logp_NT=logp_NT.detach(), ref_logp_NT=ref_NT,
                                            adv_N=adv_G[idx].to(logp_NT), mask_NT=mb.mask_NT), self.algo_cfg)
            out.loss_sum.backward()
            for acc, p in zip(self.acc, self.params):
                if p.grad is not None:
                    acc += p.grad
                    p.grad = None
            sampled_NT = torch.zeros_like(logp_NT)
            for n, i in enumerate(idx):
                sampled_NT[n, : group.logprobs[i].numel()] = group.logprobs[i]
            mismatch = torch.maximum(mismatch, ((logp_NT.detach() - sampled_NT).abs() * mb.mask_NT).max().double())
            sums["loss_sum"] += out.loss_sum.item()
            sums["denom"] += out.denom
            sums["kl_sum"] += out.stats.get("kl_sum", 0.0)
            sums["clip_sum"] += out.stats.get("clip_sum", 0.0)
            sums["tokens"] += mb.tokens
        rewards = group.rewards.double()
        sums["reward_sum"] = rewards.sum().item()
        sums["reward_sq_sum"] = (rewards ** 2).sum().item()
        sums["samples"] = len(group.responses)
        sums["len_sum"] = float(sum(r.numel() for r in group.responses))
        sums["groups"] = 1.0
        sums["reward_failures"] = float(group.reward_failures)
        return torch.tensor([sums[k] for k in _SUMS], dtype=torch.float64), mismatch

    def _barrier(self, sums: torch.Tensor, mismatch: torch.Tensor, digests: dict[int, str]):
        """All groups consumed: reduce over dp, normalise once, clip, step; the push follows."""
        if self.units > 1:
            group = self.env.group
            dist.all_reduce(sums, group=group)
            dist.all_reduce(mismatch, op=dist.ReduceOp.MAX, group=group)
            for acc in self.acc:
                dist.all_reduce(acc, group=group)
            gathered = [None] * self.units
            dist.all_gather_object(gathered, digests, group=group)
            digests = {k: v for d in gathered for k, v in d.items()}
        denom = sums[_SUMS.index("denom")].item()
        assert denom > 0, "barrier reached with an empty batch"
        for acc, p in zip(self.acc, self.params):
            p.grad = (acc / denom).to(p.dtype)
            acc.zero_()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip).item()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        digest = hashlib.sha256("".join(digests[i] for i in sorted(digests)).encode()).hexdigest()[:16]
        return sums, mismatch, digest, grad_norm

    def _metrics(self, m: dict, mismatch: float, digest: str, grad_norm: float, *, train_s, push_s):
        n, denom = m["samples"], m["denom"]
        mean = m["reward_sum"] / n
        return {"reward_mean": mean, "reward_std": math.sqrt(max(0.0, m["reward_sq_sum"] / n - mean * mean)),
                "response_len_mean": m["len_sum"] / n, "loss": m["loss_sum"] / denom,
                "kl": m["kl_sum"] / denom, "clip_frac": m["clip_sum"] / denom, "grad_norm": grad_norm,
                "lr": self.sched.get_last_lr()[0], "logp_mismatch_max": mismatch,
                "groups": int(m["groups"]), "reward_failures": int(m["reward_failures"]),
                "tokens": int(m["tokens"]), "train_s": train_s, "push_s": push_s, "rollout_digest": digest}

    # ---- outputs ----------------------------------------------------------------------------
    def save_checkpoint(self, path: Path) -> None:
        if self.env.is_leader:
            save_hf(self.policy, self.tokenizer, path)
            torch.save({"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()},
                       path / "trainer_state.pt")

    def finalize(self, output_dir: Path) -> None:
        if self.env.is_leader:
            save_hf(self.policy, self.tokenizer, output_dir / "final")


def _group_digest(group: ScoredGroup) -> str:
    h = hashlib.sha256(f"{group.index}:{group.prompt_ids.tolist()}".encode())
    for r in group.responses:
        h.update(r.to(torch.int64).numpy().tobytes() + b"|")
    return h.hexdigest()
