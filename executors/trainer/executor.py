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
from pydantic import BaseModel, ConfigDict, Field, field_validator

from algorithms.base import Algorithm, AlgoConfig, LossInputs
from algorithms.batch_scope import (batch_mean_scale, batch_normalise, batch_normalise_at_barrier, linear_passes,
                                    score_moments)
from algorithms.kl import kl_in_loss, kl_in_reward, kl_penalised_rewards
from channels.payloads import ScoredGroup, WeightsUpdate
from executors.base import Executor, ExecutorEnv, StepContext
from executors.hf import load_model, load_tokenizer, save_hf
from executors.parallel import copy_params_
from executors.trainer.packed_attention import install as install_packed_attention
from executors.trainer.packing import auto_shared_prompt, make_micro_batches


# per optimizer step: loss passes and their denominators, all-reduced over dp at each barrier
_SUMS = ("loss_score", "loss_one", "loss_zero", "denom", "kl_sum", "clip_sum", "mismatch")
# per step, once per group: what was sampled and scored, and the tokens one pass trains on
_RECORD = ("reward_sum", "reward_sq_sum", "samples", "len_sum", "groups", "reward_failures", "tokens")


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dp: int = Field(1, ge=1, description="data-parallel trainer ranks; group i trains on rank i % dp")
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from lr/(warmup+1)")
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    grad_clip: float = Field(1.0, gt=0, description="max global grad norm")
    shared_prompt: Literal["on", "off", "auto", "padded"] = Field(
        "auto", description="on: a group is one packed row [prompt, r_1..r_G] (prompt trained once); off: "
        "varlen packing, no padding; auto: on when sharing saves >= 5% of the tokens; padded: the unpacked "
        "reference ([prompt, r_i] rows padded, micro_batch_size rows per micro-batch)")
    @field_validator("shared_prompt", mode="before")
    @classmethod
    def _yaml_on_off(cls, value):
        # YAML 1.1 reads bare on/off as booleans (in config files and --set alike)
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    token_budget: int = Field(4096, ge=1, description="tokens per packed micro-batch (a group splits by sample index)")
    micro_batch_size: int = Field(8, ge=1, description="sequences per micro-batch with shared_prompt=padded")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per epoch over the batch; group i "
                              "is in mini-batch (i // dp) % mini_batches")
    epochs: int = Field(1, ge=1, description="passes over the batch (PPO-style); >1 uses the old-policy snapshot")
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
    def batch_scope(self) -> bool:
        return self.algo.advantage_scope == "batch"

    @property
    def uses_reference(self) -> bool:
        return getattr(self.algo_cfg, "beta", 0.0) > 0

    def init(self, env: ExecutorEnv) -> None:
        super().init(env)
        self.tokenizer = load_tokenizer(self.model_path)
        self.policy = load_model(self.model_path, dtype=self.dtype, seed=env.seed).to(env.device).train()
        if self.cfg.shared_prompt != "padded":  # packed rows need the block-mask attention (copies inherit it)
            install_packed_attention(self.policy)
        self.reference = None
        if self.uses_reference:
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        # a real old-policy snapshot only when several optimizer steps share one batch
        self.old = copy.deepcopy(self.policy).eval().requires_grad_(False) if self.passes > 1 else None
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
        """First pass: groups of mini-batch 0 train as they arrive (ratio 1: the policy still holds
        the generation weights); later mini-batches and epochs run once all groups are in, in
        index order, against the old-policy snapshot. One optimizer step per mini-batch."""
        if self.old is not None:
            copy_params_(self.old, self.policy)  # the weights that generated this step's samples
        record = torch.zeros(len(_RECORD), dtype=torch.float64)
        digests, held, self.moments, self.scores = {}, [], {}, {}
        self.totals = dict.fromkeys(("loss", "denom", "kl", "clip", "grad_norm", "mismatch"), 0.0)
        step_sums = torch.zeros(len(_SUMS), dtype=torch.float64)
        train_s, first_train_t = 0.0, None
        groups = ctx.inbound["scored"] if self.stream else list(ctx.inbound["scored"])
        for group in groups:
            t0 = time.perf_counter()
            first_train_t = first_train_t or time.time()
            record += _record(group, shared=self._shares_prompt(group))
            digests[group.index] = _group_digest(group)
            if self.batch_scope:  # every group's scores are needed at the barrier, trained now or later
                self.moments[group.index] = score_moments(self._group_scores(group))
            if self.passes > 1:
                held.append(group)
            if self._mini_batch(group.index) == 0:
                with ctx.timeline.span("train", index=group.index):
                    step_sums = _merge(step_sums, self._train_group(group, first_pass=True))
            train_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        with ctx.timeline.span("barrier"):
            record, digests = self._gather(record, digests)
            self._optimizer_step(step_sums, first_pass=True)
            for epoch in range(self.cfg.epochs):  # later passes: all groups are in
                for mb in range(self.cfg.mini_batches):
                    if (epoch, mb) == (0, 0):
                        continue
                    step_sums = torch.zeros(len(_SUMS), dtype=torch.float64)
                    for g in sorted(held, key=lambda g: g.index):
                        if self._mini_batch(g.index) == mb:
                            step_sums = _merge(step_sums, self._train_group(g, first_pass=False))
                    self._optimizer_step(step_sums, first_pass=False)
            self.lr_used = self.opt.param_groups[0]["lr"]
            self.sched.step()
        train_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        with ctx.timeline.span("push"):
            ctx.outbound["weights"].push(self.policy.named_parameters())
            ctx.outbound["weights"].flush()
        push_s = time.perf_counter() - t0
        digest = hashlib.sha256("".join(digests[i] for i in sorted(digests)).encode()).hexdigest()[:16]
        return {**self._metrics(dict(zip(_RECORD, record.tolist())), digest, train_s=train_s, push_s=push_s),
                "first_train_t": first_train_t, "push_end_t": time.time()}

    def _shares_prompt(self, group: ScoredGroup) -> bool:
        mode = self.cfg.shared_prompt
        return mode == "on" or (mode == "auto" and auto_shared_prompt(
            group.prompt_ids.numel(), [r.numel() for r in group.responses]))

    @property
    def passes(self) -> int:
        return self.cfg.epochs * self.cfg.mini_batches

    def _mini_batch(self, index: int) -> int:
        # groups i and i + dp land on different dp ranks; stepping over dp keeps mini-batches balanced
        return (index // self.units) % self.cfg.mini_batches

    def _group_scores(self, group: ScoredGroup, mbs=None, refs=None) -> torch.Tensor:
        """`_scores` once per group and step (it may run reference forwards for a KL in the reward)."""
        if group.index not in self.scores:
            self.scores[group.index] = self._scores(group, mbs, refs)
        return self.scores[group.index]

    def _scores(self, group: ScoredGroup, mbs=None, refs=None) -> torch.Tensor:
        """The algorithm's advantages (batch scope: the scores, normalised later) of one group."""
        lengths_G = torch.tensor([r.numel() for r in group.responses])
        rewards_G = self.algo.shape_rewards(group.rewards, lengths_G, self.algo_cfg)
        if kl_in_reward(self.algo_cfg):
            mbs = mbs or self._micro_batches(group)
            refs = refs or self._ref_logprobs(mbs)
            rewards_G = rewards_G.clone().to(torch.float64)
            for mb, ref_NT in zip(mbs, refs):
                idx = list(mb.samples)
                rewards_G[idx] = kl_penalised_rewards(
                    rewards_N=rewards_G[idx], logp_NT=_sampled_logprobs(group, idx, like=ref_NT),
                    ref_logp_NT=ref_NT, mask_NT=mb.mask_NT, cfg=self.algo_cfg)
        return self.algo.advantages(rewards_G, self.algo_cfg)

    def _micro_batches(self, group: ScoredGroup):
        # fixed by the group alone (sample index order), never by arrival: determinism rule 2
        return make_micro_batches(group.prompt_ids, group.responses, mode=self.cfg.shared_prompt,
                                  token_budget=self.cfg.token_budget, micro_batch_size=self.cfg.micro_batch_size,
                                  pad_id=self.tokenizer.pad_token_id, device=self.env.device)

    def _ref_logprobs(self, mbs) -> list:
        if self.reference is None:
            return [None] * len(mbs)
        with torch.no_grad():  # frozen: no graph; the same micro-batch feeds all three models
            return [mb.logprobs(self.reference, temperature=self.temperature) for mb in mbs]

    def _train_group(self, group: ScoredGroup, *, first_pass: bool) -> torch.Tensor:
        """Forward/backward of one group's micro-batches; gradients go to the accumulators."""
        mbs = self._micro_batches(group)
        refs = self._ref_logprobs(mbs)
        score_G = self._group_scores(group, mbs, refs)
        linear = self.batch_scope and first_pass
        if self.batch_scope and not first_pass:  # mean and std of the batch are known by now
            score_G = batch_normalise(score_G, mu=self.mu_scale[0], scale=self.mu_scale[1])
        sums = dict.fromkeys(_SUMS, 0.0)
        for mb, ref_NT in zip(mbs, refs):
            logp_NT = mb.logprobs(self.policy, temperature=self.temperature)
            if first_pass:
                old_NT = logp_NT.detach()  # the policy IS the old policy until the first optimizer step
            else:
                with torch.no_grad():
                    old_NT = mb.logprobs(self.old, temperature=self.temperature)
            idx = list(mb.samples)
            score_N = score_G[idx].to(logp_NT)
            # group scope: one pass at the advantages; batch scope: the loss at s, 1 (and 0), combined
            # exactly at the barrier once the batch's mean and std are known (algorithms/batch_scope.py)
            passes = linear_passes(score_N, self.algo_cfg) if linear else {"score": score_N}
            for k, (name, adv_N) in enumerate(passes.items()):
                out = self.algo.loss(LossInputs(logp_NT=logp_NT, old_logp_NT=old_NT, ref_logp_NT=ref_NT,
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
            if first_pass:  # on-policy check: the trainer recomputes what the generator sampled
                sampled_NT = _sampled_logprobs(group, idx, like=logp_NT)
                gap = ((logp_NT.detach() - sampled_NT).abs() * mb.mask_NT).max().item()
                sums["mismatch"] = max(sums["mismatch"], gap)
        return torch.tensor([sums[k] for k in _SUMS], dtype=torch.float64)

    def _gather(self, record: torch.Tensor, digests: dict[int, str]):
        """Once per step, all groups in: per-group records, digests and score moments over dp."""
        if self.units > 1:
            dist.all_reduce(record, group=self.env.group)
            gathered = [None] * self.units
            dist.all_gather_object(gathered, (digests, self.moments), group=self.env.group)
            digests = {k: v for d, _ in gathered for k, v in d.items()}
            self.moments = {k: v for _, m in gathered for k, v in m.items()}
        if self.batch_scope:
            self.mu_scale = batch_mean_scale(self.moments, eps=self.algo_cfg.eps)
        return record, digests

    def _optimizer_step(self, sums: torch.Tensor, *, first_pass: bool) -> None:
        """Reduce over dp, normalise once by the batch denominator, clip, step."""
        mismatch = sums[_SUMS.index("mismatch")].clone()
        if self.units > 1:
            dist.all_reduce(sums, group=self.env.group)
            dist.all_reduce(mismatch, op=dist.ReduceOp.MAX, group=self.env.group)
            for name in self._live_passes(first_pass):
                for acc in self.acc[name]:
                    dist.all_reduce(acc, group=self.env.group)
        m = dict(zip(_SUMS, sums.tolist()))
        grads, loss = self.acc["score"], m["loss_score"]
        if self.batch_scope and first_pass:
            mu, scale = self.mu_scale
            zeros = self.acc.get("zero", [None] * len(self.params))
            grads = [batch_normalise_at_barrier(at_score=s, at_one=o, at_zero=z, mu=mu, scale=scale)
                     for s, o, z in zip(self.acc["score"], self.acc["one"], zeros)]
            loss = batch_normalise_at_barrier(at_score=m["loss_score"], at_one=m["loss_one"],
                                              at_zero=m["loss_zero"] if "zero" in self.acc else None,
                                              mu=mu, scale=scale)
        assert m["denom"] > 0, "optimizer step with an empty mini-batch"
        for grad, p in zip(grads, self.params):
            p.grad = (grad / m["denom"]).to(p.dtype)
        for accs in self.acc.values():
            for acc in accs:
                acc.zero_()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip).item()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t = self.totals
        t["loss"] += loss
        t["denom"] += m["denom"]
        t["kl"] += m["kl_sum"]
        t["clip"] += m["clip_sum"]
        t["grad_norm"] += grad_norm / self.passes
        t["mismatch"] = max(t["mismatch"], mismatch.item())

    def _live_passes(self, first_pass: bool) -> list[str]:
        return list(self.acc) if first_pass else ["score"]

    def _metrics(self, r: dict, digest: str, *, train_s, push_s):
        n, t = r["samples"], self.totals
        mean = r["reward_sum"] / n
        return {"reward_mean": mean, "reward_std": math.sqrt(max(0.0, r["reward_sq_sum"] / n - mean * mean)),
                "response_len_mean": r["len_sum"] / n, "loss": t["loss"] / t["denom"],
                "kl": t["kl"] / t["denom"], "clip_frac": t["clip"] / t["denom"], "grad_norm": t["grad_norm"],
                "lr": self.lr_used, "logp_mismatch_max": t["mismatch"], "groups": int(r["groups"]),
                "reward_failures": int(r["reward_failures"]), "tokens": int(r["tokens"]),
                "optimizer_steps": self.passes, "train_s": train_s, "push_s": push_s, "rollout_digest": digest}

    # ---- outputs ----------------------------------------------------------------------------
    def save_checkpoint(self, path: Path) -> None:
        if self.env.is_leader:
            save_hf(self.policy, self.tokenizer, path)
            torch.save({"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()},
                       path / "trainer_state.pt")

    def finalize(self, output_dir: Path) -> None:
        if self.env.is_leader:
            save_hf(self.policy, self.tokenizer, output_dir / "final")


def _record(group: ScoredGroup, *, shared: bool) -> torch.Tensor:
    rewards = group.rewards.double()
    responses = float(sum(r.numel() for r in group.responses))
    # tokens one pass trains on: a shared prompt once per group, else once per sample
    tokens = (1 if shared else len(group.responses)) * group.prompt_ids.numel() + responses
    return torch.tensor([rewards.sum().item(), (rewards ** 2).sum().item(), len(group.responses), responses,
                         1.0, float(group.reward_failures), tokens], dtype=torch.float64)


def _merge(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """Sums add; the log-prob mismatch is a max."""
    i = _SUMS.index("mismatch")
    out = total + part
    out[i] = max(total[i].item(), part[i].item())
    return out


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
