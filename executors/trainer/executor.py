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
from algorithms.batch_scope import batch_mean_scale, batch_normalise_at_barrier, linear_passes, score_moments
from algorithms.kl import kl_in_loss, kl_in_reward, kl_penalised_rewards
from channels.payloads import ScoredGroup, WeightsUpdate
from executors.base import Executor, ExecutorEnv, StepContext
from executors.hf import load_model, load_tokenizer, save_hf
from executors.trainer.batching import split_group


# per-step sums, all-reduced over dp at the barrier
_SUMS = ("loss_score", "loss_one", "loss_zero", "denom", "kl_sum", "clip_sum", "tokens", "reward_sum", "reward_sq_sum", "samples",
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
        if getattr(algo_config, "dynamic_sampling", False):
            raise ValueError(f"algorithm {algorithm.name!r}: dynamic sampling (dropping groups with equal "
                             "rewards and topping the batch up) is not supported by this trainer yet; "
                             "run with --set algorithm.dynamic_sampling=false")

    def describe(self):
        return {"dp": self.cfg.dp, "algo": self.algo.name, "stream": self.stream,
                "reference": self.uses_reference}

    @property
    def batch_scope(self) -> bool:
        return self.algo.advantage_scope == "batch"

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
        passes = ["score"] + (["one"] + (["zero"] if kl_in_loss(self.algo_cfg) else []) if self.batch_scope else [])
        self.acc = {name: [torch.zeros_like(p, dtype=acc_dtype or p.dtype) for p in self.params] for name in passes}

    # ---- one step -------------------------------------------------------------------------
    def step(self, ctx: StepContext):
        sums = torch.zeros(len(_SUMS), dtype=torch.float64)
        mismatch = torch.zeros((), dtype=torch.float64)  # max |trainer logp - sampling logp|
        digests: dict[int, str] = {}
        self.moments: dict[int, torch.Tensor] = {}  # batch-scope advantages: score moments per group
        train_s, first_train_t = 0.0, None
        groups = ctx.inbound["scored"] if self.stream else list(ctx.inbound["scored"])
        for group in groups:
            t0 = time.perf_counter()
            first_train_t = first_train_t or time.time()
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
        return {**self._metrics(metrics, mismatch.item(), digest, grad_norm, train_s=train_s, push_s=push_s),
                "first_train_t": first_train_t, "push_end_t": time.time()}

    def _rewards(self, group: ScoredGroup, mbs, refs) -> torch.Tensor:
        """The group's rewards after the algorithm's shaping and, if asked, the KL-in-reward penalty."""
        lengths_G = torch.tensor([r.numel() for r in group.responses])
        rewards_G = self.algo.shape_rewards(group.rewards, lengths_G, self.algo_cfg)
        if kl_in_reward(self.algo_cfg):
            for mb, ref_NT in zip(mbs, refs):
                idx = list(mb.samples)
                sampled_NT = _sampled_logprobs(group, idx, like=ref_NT)
                rewards_G = rewards_G.clone().to(torch.float64)
                rewards_G[idx] = kl_penalised_rewards(rewards_N=rewards_G[idx], logp_NT=sampled_NT,
                                                      ref_logp_NT=ref_NT, mask_NT=mb.mask_NT, cfg=self.algo_cfg)
        return rewards_G

    def _train_group(self, group: ScoredGroup) -> tuple[torch.Tensor, torch.Tensor]:
        mbs = split_group(group.prompt_ids, group.responses, micro_batch_size=self.cfg.micro_batch_size,
                          pad_id=self.tokenizer.pad_token_id, device=self.env.device)
        refs = [None] * len(mbs)
        if self.reference is not None:  # frozen: no graph, computed once for the KL (loss or reward)
            with torch.no_grad():
                refs = [mb.logprobs(self.reference, temperature=self.temperature) for mb in mbs]
        score_G = self.algo.advantages(self._rewards(group, mbs, refs), self.algo_cfg)
        if self.batch_scope:
            self.moments[group.index] = score_moments(score_G)
        sums = dict.fromkeys(_SUMS, 0.0)
        mismatch = torch.zeros((), dtype=torch.float64)
        for mb, ref_NT in zip(mbs, refs):
            logp_NT = mb.logprobs(self.policy, temperature=self.temperature)
            idx = list(mb.samples)
            score_N = score_G[idx].to(logp_NT)
            # group scope: one pass at the advantages; batch scope: the loss at s, 1 (and 0), combined
            # exactly at the barrier once the batch's mean and std are known (algorithms/batch_scope.py)
            passes = linear_passes(score_N, self.algo_cfg) if self.batch_scope else {"score": score_N}
            for k, (name, adv_N) in enumerate(passes.items()):
                out = self.algo.loss(LossInputs(logp_NT=logp_NT, old_logp_NT=logp_NT.detach(), ref_logp_NT=ref_NT,
                                                adv_N=adv_N, mask_NT=mb.mask_NT), self.algo_cfg)
                out.loss_sum.backward(retain_graph=k < len(passes) - 1)
                for acc, p in zip(self.acc[name], self.params):
                    if p.grad is not None:
                        acc += p.grad
                        p.grad = None
                sums[f"loss_{name}"] += out.loss_sum.item()
                if name == "score":
                    sums["denom"] += out.denom
                    sums["kl_sum"] += out.stats.get("kl_sum", 0.0)
                    sums["clip_sum"] += out.stats.get("clip_sum", 0.0)
            sampled_NT = _sampled_logprobs(group, idx, like=logp_NT)
            mismatch = torch.maximum(mismatch, ((logp_NT.detach() - sampled_NT).abs() * mb.mask_NT).max().double())
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
            for accs in self.acc.values():
                for acc in accs:
                    dist.all_reduce(acc, group=group)
            gathered = [None] * self.units
            dist.all_gather_object(gathered, (digests, self.moments), group=group)
            digests = {k: v for d, _ in gathered for k, v in d.items()}
            self.moments = {k: v for _, m in gathered for k, v in m.items()}
        grads = self.acc["score"]
        if self.batch_scope:
            mu, scale = batch_mean_scale(self.moments, eps=self.algo_cfg.eps)
            zeros = self.acc.get("zero", [None] * len(self.params))
            grads = [batch_normalise_at_barrier(at_score=s, at_one=o, at_zero=z, mu=mu, scale=scale)
                     for s, o, z in zip(self.acc["score"], self.acc["one"], zeros)]
            i = {k: _SUMS.index(f"loss_{k}") for k in ("score", "one", "zero")}
            sums[i["score"]] = batch_normalise_at_barrier(
                at_score=sums[i["score"]].item(), at_one=sums[i["one"]].item(),
                at_zero=sums[i["zero"]].item() if "zero" in self.acc else None, mu=mu, scale=scale)
        denom = sums[_SUMS.index("denom")].item()
        assert denom > 0, "barrier reached with an empty batch"
        for grad, p in zip(grads, self.params):
            p.grad = (grad / denom).to(p.dtype)
        for accs in self.acc.values():
            for acc in accs:
                acc.zero_()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip).item()
        self.lr_used = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        digest = hashlib.sha256("".join(digests[i] for i in sorted(digests)).encode()).hexdigest()[:16]
        return sums, mismatch, digest, grad_norm

    def _metrics(self, m: dict, mismatch: float, digest: str, grad_norm: float, *, train_s, push_s):
        n, denom = m["samples"], m["denom"]
        mean = m["reward_sum"] / n
        return {"reward_mean": mean, "reward_std": math.sqrt(max(0.0, m["reward_sq_sum"] / n - mean * mean)),
                "response_len_mean": m["len_sum"] / n, "loss": m["loss_score"] / denom,
                "kl": m["kl_sum"] / denom, "clip_frac": m["clip_sum"] / denom, "grad_norm": grad_norm,
                "lr": self.lr_used, "logp_mismatch_max": mismatch,
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


def _sampled_logprobs(group: ScoredGroup, idx: list[int], *, like: torch.Tensor) -> torch.Tensor:
    """The generator's sampling log-probs of samples `idx`, padded like a micro-batch's [N, T]."""
    out_NT = torch.zeros_like(like)
    for n, i in enumerate(idx):
        out_NT[n, : group.logprobs[i].numel()] = group.logprobs[i]
    return out_NT


def _group_digest(group: ScoredGroup) -> str:
    h = hashlib.sha256(f"{group.index}:{group.prompt_ids.tolist()}".encode())
    for r in group.responses:
        h.update(r.to(torch.int64).numpy().tobytes() + b"|")
    return h.hexdigest()
