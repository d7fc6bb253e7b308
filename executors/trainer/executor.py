"""The tri-model trainer: policy, old policy, reference, in one layout, one micro-step.

With one optimizer step per batch the old policy equals the policy during the whole step, so its
log-probs are the detached policy log-probs (no extra forward); the reference (the initial weights,
frozen) runs only when the algorithm's KL coefficient is non-zero.
Gradients accumulate per micro-batch into float64 buffers (order-independent in practice: sums of
float32 values in float64 do not round), and the batch denominator is applied once at the barrier.

Parallel layout: a ("dp", "tp") mesh over the trainer's ranks; a unit (one dp slot) is tp ranks.
All three models are parallelized alike (executors/parallel): tp shards them over the unit, FSDP
shards them over dp, without it dp replicates them. Accumulators hold this rank's local shards;
records and loss sums are reduced over dp only (a unit's tp ranks hold the same numbers).
executors/trainer/order.py says in which order a rank takes its groups under each layout.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import itertools
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from algorithms.base import Algorithm, AlgoConfig, LossInputs
from algorithms.batch_scope import (batch_mean_scale, batch_normalise, batch_normalise_at_barrier, linear_passes,
                                    score_moments)
from algorithms.kl import kl_in_loss, kl_in_reward, kl_penalised_rewards
from channels.payloads import ScoredGroup, WeightsUpdate
from executors.base import Executor, ExecutorEnv, StepContext
from executors.hf import load_model, load_tokenizer, save_hf
from executors.parallel import (build_mesh, clip_grad_norm_, copy_params_, full_state_dict, local, local_shards,
                                param_specs, parallelize)
from executors.trainer import stats
from executors.trainer.config import TrainerConfig, lr_factor
from executors.trainer.order import in_index_order, round_length
from executors.trainer.packed_attention import install as install_packed_attention
from executors.trainer.packing import auto_shared_prompt, make_micro_batches

__all__ = ["Trainer", "TrainerConfig"]


class Trainer(Executor):
    inputs = {"scored": ScoredGroup}
    outputs = {"weights": WeightsUpdate}

    def __init__(self, *, name: str = "trainer", config: TrainerConfig, model_path: str | None,
                 dtype: torch.dtype, algorithm: Algorithm, algo_config: AlgoConfig,
                 temperature: float, stream: bool, total_steps: int):
        super().__init__(name=name, units=config.dp, ranks_per_unit=config.tp)
        self.cfg, self.model_path, self.dtype = config, model_path, dtype
        # FSDP over several dp units: they also train in lockstep rounds (order.py)
        self.shards_over_units = config.fsdp and config.dp > 1
        self.ordered = config.tp > 1 or self.shards_over_units  # order.py
        self.algo, self.algo_cfg, self.temperature = algorithm, algo_config, temperature
        self.stream, self.total_steps = stream, total_steps

    def describe(self):
        return {"dp": self.cfg.dp, "tp": self.cfg.tp, "fsdp": self.cfg.fsdp, "algo": self.algo.name,
                "stream": self.stream, "reference": self.uses_reference}

    @property
    def batch_scope(self) -> bool:
        return self.algo.advantage_scope == "batch"

    @property
    def uses_reference(self) -> bool:
        return getattr(self.algo_cfg, "beta", 0.0) > 0

    def init(self, env: ExecutorEnv) -> None:
        super().init(env)
        self.tokenizer = load_tokenizer(self.model_path)
        cfg = self.cfg
        # None: a one-rank trainer used without torch.distributed (tests, notebooks)
        self.mesh = (build_mesh(ranks=env.ranks, tp=cfg.tp, device_type=env.device.type, parent=env.group)
                     if dist.is_initialized() else None)
        self.dp_group = self.mesh.get_group("dp") if self.mesh is not None else None
        self.policy = load_model(self.model_path, dtype=self.dtype, seed=env.seed).to(env.device).train()
        if cfg.shared_prompt != "padded":  # packed rows need the block-mask attention (copies inherit it)
            install_packed_attention(self.policy)
        # copies before sharding: each model is then parallelized alike (same shards on the same ranks)
        self.reference = None
        if self.uses_reference:
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        # a real old-policy snapshot only when several optimizer steps share one batch
        self.old = copy.deepcopy(self.policy).eval().requires_grad_(False) if self.passes > 1 else None
        for model, forward_only in ((self.policy, False), (self.reference, True), (self.old, True)):
            if model is not None and (cfg.tp > 1 or cfg.fsdp):
                parallelize(model, mesh=self.mesh, tp=cfg.tp > 1, fsdp=cfg.fsdp, forward_only=forward_only)
        self.specs = param_specs(self.policy)  # for the WEIGHTS channel's plan
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                                     weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(
            s, warmup=self.cfg.warmup_steps, schedule=self.cfg.lr_schedule, total=self.total_steps,
            floor=self.cfg.min_lr_ratio))
        acc_dtype = torch.float64 if self.cfg.fp64_grad_accumulation else None
        passes = ["score"] + (["one"] + (["zero"] if kl_in_loss(self.algo_cfg) else []) if self.batch_scope else [])
        self.acc = {name: [torch.zeros_like(local(p), dtype=acc_dtype or p.dtype) for p in self.params]
                    for name in passes}

    # ---- one step -------------------------------------------------------------------------
    def step(self, ctx: StepContext):
        """First pass: groups of mini-batch 0 train as they arrive (ratio 1: the policy still holds
        the generation weights); later mini-batches and epochs run once all groups are in, in
        index order, against the old-policy snapshot. One optimizer step per mini-batch."""
        if self.old is not None:
            copy_params_(self.old, self.policy)  # the weights that generated this step's samples
        record = torch.zeros(len(stats.RECORD), dtype=torch.float64)
        digests, held, self.moments, self.scores = {}, [], {}, {}
        self.totals = dict.fromkeys(("loss", "denom", "kl", "clip", "grad_norm", "mismatch"), 0.0)
        step_sums = torch.zeros(len(stats.SUMS), dtype=torch.float64)
        train_s, first_train_t = 0.0, None
        groups = ctx.inbound["scored"] if self.stream else list(ctx.inbound["scored"])
        if self.ordered:
            groups = in_index_order(groups, first=self.env.unit_index, stride=self.units)
        for mini_batch, group, mbs, steps in self._schedule(groups):
            t0 = time.perf_counter()
            if group is not None:
                first_train_t = first_train_t or time.time()
                record += stats.record(group, shared=self._shares_prompt(group))
                digests[group.index] = stats.group_digest(group)
                if self.passes > 1:
                    held.append(group)
            train = mini_batch == 0
            # reference log-probs: for the loss, or for a KL in the reward the batch moments need now
            refs = (self._ref_logprobs(mbs, pad_to=steps)
                    if train or (self.batch_scope and kl_in_reward(self.algo_cfg)) else None)
            if self.batch_scope and group is not None:  # every group's scores are needed at the barrier
                self.moments[group.index] = score_moments(self._group_scores(group, mbs, refs))
            if train:
                with ctx.timeline.span("train", index=group.index if group is not None else -1):
                    step_sums = stats.merge(step_sums, self._train_group(group, mbs, refs, steps, first_pass=True))
            train_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        with ctx.timeline.span("barrier"):
            record, digests = self._gather(record, digests)
            self._optimizer_step(step_sums, first_pass=True)
            for epoch in range(self.cfg.epochs):  # later passes: all groups are in
                for mb in range(self.cfg.mini_batches):
                    if (epoch, mb) == (0, 0):
                        continue
                    step_sums = torch.zeros(len(stats.SUMS), dtype=torch.float64)
                    mine = sorted((g for g in held if self._mini_batch(g.index) == mb), key=lambda g: g.index)
                    for _, g, mbs, steps in self._schedule(mine):
                        refs = self._ref_logprobs(mbs, pad_to=steps)
                        step_sums = stats.merge(step_sums, self._train_group(g, mbs, refs, steps, first_pass=False))
                    self._optimizer_step(step_sums, first_pass=False)
            self.lr_used = self.opt.param_groups[0]["lr"]
            self.sched.step()
        train_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        with ctx.timeline.span("push"):
            ctx.outbound["weights"].push(local_shards(self.policy), self.specs)
            ctx.outbound["weights"].flush()
        push_s = time.perf_counter() - t0
        digest = hashlib.sha256("".join(digests[i] for i in sorted(digests)).encode()).hexdigest()[:16]
        return {**self._metrics(dict(zip(stats.RECORD, record.tolist())), digest, train_s=train_s, push_s=push_s),
                "first_train_t": first_train_t, "push_end_t": time.time()}

    def _schedule(self, groups):
        """(mini-batch, group, its micro-batches, micro-steps to run) per unit of work.

        One per group; in lockstep one per round, the micro-steps padded to the round's longest
        group, the group None where this rank has none left, until no rank has one (order.py)."""
        groups = iter(groups)
        for k in itertools.count():
            group = next(groups, None)
            if group is None and not self.shards_over_units:
                return
            mbs = self._micro_batches(group) if group is not None else []
            steps = round_length(len(mbs), group=self.dp_group) if self.shards_over_units else len(mbs)
            if steps == 0:
                return
            # in lockstep round k holds groups k*dp .. k*dp + dp - 1, all of one mini-batch
            yield (self._mini_batch(group.index) if group is not None else k % self.cfg.mini_batches), group, mbs, steps

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

    def _group_scores(self, group: ScoredGroup, mbs, refs) -> torch.Tensor:
        """`_scores` once per group and step (it may use reference log-probs for a KL in the reward)."""
        if group.index not in self.scores:
            self.scores[group.index] = self._scores(group, mbs, refs)
        return self.scores[group.index]

    def _scores(self, group: ScoredGroup, mbs, refs) -> torch.Tensor:
        """The algorithm's advantages (batch scope: the scores, normalised later) of one group."""
        lengths_G = torch.tensor([r.numel() for r in group.responses])
        rewards_G = self.algo.shape_rewards(group.rewards, lengths_G, self.algo_cfg)
        if kl_in_reward(self.algo_cfg):
            rewards_G = rewards_G.clone().to(torch.float64)
            for mb, ref_NT in zip(mbs, refs):
                idx = list(mb.samples)
                rewards_G[idx] = kl_penalised_rewards(
                    rewards_N=rewards_G[idx], logp_NT=stats.sampled_logprobs(group, idx, like=ref_NT),
                    ref_logp_NT=ref_NT, mask_NT=mb.mask_NT, cfg=self.algo_cfg)
        return self.algo.advantages(rewards_G, self.algo_cfg)

    def _micro_batches(self, group: ScoredGroup):
        # fixed by the group alone (sample index order), never by arrival: determinism rule 2
        return self._micro_batches_of(group.prompt_ids, group.responses)

    @functools.cached_property
    def _dummy(self):
        """A one-token micro-batch for lockstep padding: it runs every collective a real one does."""
        pad = torch.tensor([self.tokenizer.pad_token_id])
        return self._micro_batches_of(pad, [pad])[0]

    def _micro_batches_of(self, prompt_ids_P, responses):
        return make_micro_batches(prompt_ids_P, responses, mode=self.cfg.shared_prompt,
                                  token_budget=self.cfg.token_budget, micro_batch_size=self.cfg.micro_batch_size,
                                  pad_id=self.tokenizer.pad_token_id, device=self.env.device)

    def _ref_logprobs(self, mbs, *, pad_to: int) -> list:
        if self.reference is None:
            return [None] * len(mbs)
        with torch.no_grad():  # frozen: no graph; the same micro-batch feeds all three models
            refs = [mb.logprobs(self.reference, temperature=self.temperature) for mb in mbs]
            for _ in range(pad_to - len(mbs)):
                self._dummy.logprobs(self.reference, temperature=self.temperature)
        return refs

    def _train_group(self, group: ScoredGroup | None, mbs, refs, steps: int, *, first_pass: bool) -> torch.Tensor:
        """Forward/backward of one group's micro-batches (then dummies up to `steps`); gradients go
        to the accumulators."""
        linear = self.batch_scope and first_pass
        sums = dict.fromkeys(stats.SUMS, 0.0)
        if group is not None:
            score_G = self._group_scores(group, mbs, refs)
            if self.batch_scope and not first_pass:  # mean and std of the batch are known by now
                score_G = batch_normalise(score_G, mu=self.mu_scale[0], scale=self.mu_scale[1])
        for k in range(steps):
            if k >= len(mbs):  # lockstep padding: weight 0, same forwards and backwards
                self._micro_step(self._dummy, None, None, first_pass=first_pass, linear=linear)
                continue
            mb, idx = mbs[k], list(mbs[k].samples)
            logp_NT = self._micro_step(mb, refs[k], score_G[idx], first_pass=first_pass, linear=linear, sums=sums)
            if first_pass:  # on-policy check: the trainer recomputes what the generator sampled
                sampled_NT = stats.sampled_logprobs(group, idx, like=logp_NT)
                gap = ((logp_NT.detach() - sampled_NT).abs() * mb.mask_NT).max().item()
                sums["mismatch"] = max(sums["mismatch"], gap)
        return torch.tensor([sums[k] for k in stats.SUMS], dtype=torch.float64)

    def _micro_step(self, mb, ref_NT, score_N, *, first_pass: bool, linear: bool, sums=None) -> torch.Tensor:
        """One micro-batch through policy (and old) forward and the loss passes' backwards.
        score_N None: a dummy, its loss multiplied by 0."""
        logp_NT = mb.logprobs(self.policy, temperature=self.temperature)
        if first_pass:
            old_NT = logp_NT.detach()  # the policy IS the old policy until the first optimizer step
        else:
            with torch.no_grad():
                old_NT = mb.logprobs(self.old, temperature=self.temperature)
        # group scope: one pass at the advantages; batch scope: the loss at s, 1 (and 0), combined
        # exactly at the barrier once the batch's mean and std are known (algorithms/batch_scope.py)
        if score_N is None:  # a dummy: the same passes, no advantages
            passes = dict.fromkeys(self.acc if linear else ["score"])
        else:
            passes = linear_passes(score_N, self.algo_cfg) if linear else {"score": score_N}
        # FSDP frees the gathered weights after each backward, so a second backward over the same
        # graph would read freed storage: recompute the forward per pass instead of retain_graph
        recompute = self.cfg.fsdp
        for k, (name, adv_N) in enumerate(passes.items()):
            if k and recompute:
                logp_NT = mb.logprobs(self.policy, temperature=self.temperature)
            if adv_N is None:
                loss = (logp_NT * 0).sum()
            else:
                out = self.algo.loss(LossInputs(logp_NT=logp_NT, old_logp_NT=old_NT, ref_logp_NT=ref_NT,
                                                adv_N=adv_N.to(logp_NT), mask_NT=mb.mask_NT), self.algo_cfg)
                loss = out.loss_sum
                sums[f"loss_{name}"] += out.loss_sum.item()
                if name == "score":
                    sums["denom"] += out.denom
                    sums["kl_sum"] += out.stats.get("kl_sum", 0.0)
                    sums["clip_sum"] += out.stats.get("clip_sum", 0.0)
            loss.backward(retain_graph=not recompute and k < len(passes) - 1)
            for acc, p in zip(self.acc[name], self.params):
                if p.grad is not None:  # with FSDP: the dp sum of this shard, dummies included
                    acc += local(p.grad)
                    p.grad = None
        return logp_NT

    def _gather(self, record: torch.Tensor, digests: dict[int, str]):
        """Once per step, all groups in: per-group records, digests and score moments over dp."""
        if self.units > 1:
            dist.all_reduce(record, group=self.dp_group)
            gathered = [None] * self.units
            dist.all_gather_object(gathered, (digests, self.moments), group=self.dp_group)
            digests = {k: v for d, _ in gathered for k, v in d.items()}
            self.moments = {k: v for _, m in gathered for k, v in m.items()}
        if self.batch_scope:
            self.mu_scale = batch_mean_scale(self.moments, eps=self.algo_cfg.eps)
        return record, digests

    def _optimizer_step(self, sums: torch.Tensor, *, first_pass: bool) -> None:
        """Reduce over dp, normalise once by the batch denominator, clip, step."""
        mismatch = sums[stats.SUMS.index("mismatch")].clone()
        if self.units > 1:
            dist.all_reduce(sums, group=self.dp_group)
            dist.all_reduce(mismatch, op=dist.ReduceOp.MAX, group=self.dp_group)
            if not self.shards_over_units:  # FSDP reduce-scattered each micro-step's gradients already
                for name in self._live_passes(first_pass):
                    for acc in self.acc[name]:
                        dist.all_reduce(acc, group=self.dp_group)
        m = dict(zip(stats.SUMS, sums.tolist()))
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
            g = (grad / m["denom"]).to(p.dtype)
            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                        run_check=False) if isinstance(p, DTensor) else g
        for accs in self.acc.values():
            for acc in accs:
                acc.zero_()
        grad_norm = clip_grad_norm_(self.params, self.cfg.grad_clip, mesh=self.mesh)
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
        """An HF directory of the full model (gathered by every trainer rank, written by the leader)
        and each rank's own optimizer shard."""
        self._save_model(path)
        sharded = self.cfg.tp > 1 or self.shards_over_units
        if sharded or self.env.is_leader:
            name = f"trainer_state.rank{self.env.ranks.index(self.env.rank)}.pt" if sharded else "trainer_state.pt"
            path.mkdir(parents=True, exist_ok=True)
            torch.save({"optimizer": stats.local_tensors(self.opt.state_dict()), "scheduler": self.sched.state_dict()},
                       path / name)

    def finalize(self, output_dir: Path) -> None:
        self._save_model(output_dir / "final")

    def _save_model(self, path: Path) -> None:
        state = full_state_dict(self.policy, keep=self.env.is_leader)
        if self.env.is_leader:
            save_hf(self.policy, self.tokenizer, path, state=state)
