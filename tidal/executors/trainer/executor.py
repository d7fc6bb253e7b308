"""The tri-model trainer: trains prompt groups as they are handed over, then the barrier.

    step(ctx)            each group, as the schedule hands it over: its micro-batches through
                         policy / old / reference, the loss, backward into the accumulators
    barrier(ctx, state)  records over dp, optimizer step, later mini-batches and epochs, lr
                         schedule, then the weight push to the generator

What varies by algorithm (advantages, loss passes, the batch's statistics, the loss) is its objective
(tidal/algorithms/objective.py); this file keeps no algorithm flag.
Its parts: models.py (policy, old policy, reference and their log-probs), accumulate.py (gradients,
loss sums and group records as typed values), barrier.py (combine, normalise, step), stats.py (the
step's state and its metrics record); what it shares with the critic is in tidal/executors/learner/
(micro-batches, the order groups are taken in under each layout, the optimizer).
Parallel layout: a ("dp", "tp") mesh over the trainer's ranks; a unit (one dp slot) is tp ranks.
Backends (trainer.backend): torch (models.py: HF classes, DTensor tp, FSDP2) or megatron
(megatron_models.py: megatron-core GPTModels); this file and the barrier are the same for both.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from tidal.algorithms.base import Algorithm, AlgoConfig, LossInputs
from tidal.algorithms.objective import Objective
from tidal.channels.payloads import AdvantagedGroup, ScoredGroup, WeightsUpdate
from tidal.common.stop import StepAborted
from tidal.executors.base import ExecutorEnv, Input, Output, StepContext, unit_aborted
from tidal.executors.trainer.accumulate import GroupRecord, LossSums, Pass
from tidal.executors.trainer.config import TrainerConfig
from tidal.executors.trainer.stats import StepState, TrainerMetrics, group_digest
from tidal.modeling.batching import sampled_logprobs, sampled_versions
from tidal.executors.learner.learner import Learner
from tidal.executors.learner.order import Work

__all__ = ["Trainer", "TrainerConfig"]


class Trainer(Learner):
    scored = Input(ScoredGroup)  # AdvantagedGroup where the algorithm takes per-token advantages (a critic's)
    weights = Output(WeightsUpdate)

    def __init__(self, *, name: str = "trainer", config: TrainerConfig, model_path: str | None,
                 dtype: torch.dtype, algorithm: Algorithm, algo_config: AlgoConfig, temperature: float,
                 total_steps: int, samples_every: int = 0, token_advantages: bool = False, numerics: str = "default"):
        """samples_every: write samples.jsonl every N steps (0: never). token_advantages: the advantages
        arrive with each group, one per response token (AdvantagedGroup: PPO's critic), instead of being
        computed from its rewards (the recipe knows the algorithm's advantage source)."""
        super().__init__(name=name, config=config)
        self.samples_every = samples_every
        self.model_path, self.dtype, self.numerics = model_path, dtype, numerics
        self.temperature, self.total_steps = temperature, total_steps
        self.objective = Objective(algorithm, algo_config, token_advantages=token_advantages)

    def consumes(self, port):
        per_token = port is Trainer.scored and self.objective.token_advantages
        return AdvantagedGroup if per_token else super().consumes(port)

    def describe(self):
        extra = ({"cp": self.cfg.cp} if self.cfg.cp > 1 else {}) | ({"ep": self.cfg.ep} if self.cfg.ep > 1 else {}) | \
            ({"pp": self.cfg.pp} if self.cfg.pp > 1 else {}) | \
            ({"lora": f"rank {self.cfg.lora.rank}"} if self.cfg.lora.on else {})
        return {"dp": self.cfg.dp, "tp": self.cfg.tp, "fsdp": self.cfg.fsdp, **extra, "backend": self.cfg.backend,
                "algo": self.objective.algorithm.name, "reference": self.objective.needs_reference}

    def init(self, env: ExecutorEnv) -> None:
        super().init(env)
        # model code (transformers, DTensor) loads here, on the trainer's ranks: building a graph
        # (the CLI, --dry-run) stays light
        from tidal.executors.trainer.barrier import Barrier
        from tidal.modeling.loss_scale import LossScaler

        from tidal.executors.trainer.backends import BACKENDS

        self.models = BACKENDS.get(self.cfg.backend).models().build(model_path=self.model_path, dtype=self.dtype, env=env, cfg=self.cfg,
                                     temperature=self.temperature, reference=self.objective.needs_reference,
                                     snapshot=self.passes > 1, policy_path=env.weights_from, numerics=self.numerics)
        self.optim = Barrier(self.models.master, compute=self.models.policy, cfg=self.cfg.optim, total_steps=self.total_steps,
                             passes=self.objective.first_passes, layout=self.models.grad_layout(),
                             sums_over=self.models.sums_over,
                             scaler=LossScaler(self.cfg.loss_scale) if self.cfg.precision == "fp16" else None)
        self._order_sums()
        if env.resume is not None:  # the policy came from the checkpoint; the optimizer and schedule too
            self.optim.load(env.resume / "trainer", group=env.group)

    # ---- the streamed phase -----------------------------------------------------------------
    def step(self, ctx: StepContext) -> StepState:
        """Mini-batch 0 trains as its groups arrive (ratio 1: the policy still holds the generation
        weights); later mini-batches and epochs wait for the barrier."""
        self.onload(ctx)
        # the step's starting weights (the old policy): the sampler's on-policy, the proximal policy under offpolicy
        self.models.begin_step(ctx.timeline)
        state = StepState(step=ctx.step)
        for work in self._work(self._in_order(ctx.inbound[self.scored])):  # as the schedule hands them over
            # a stop drops the step: its groups need not be trained (not in lockstep, where every dp
            # rank would have to agree at the same round)
            if not self.lockstep and unit_aborted(self.env):
                raise StepAborted()
            t0 = time.perf_counter()
            with self._summing(work.group):
                self._take(work, state, ctx)
                self.models.end_of_group()
            state.train_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.models.drain()  # the backwards still in flight
        state.train_s += time.perf_counter() - t0
        return state

    def _take(self, work: Work, state: StepState, ctx: StepContext) -> None:
        group, train = work.group, work.mini_batch == 0
        if group is not None:
            state.first_train_t = state.first_train_t or time.time()
            state.record += GroupRecord.of(group, shared_prompt=self.models.shares_prompt(group))
            state.digests[group.index] = group_digest(group)
            state.versions[group.index] = group.staleness(ctx.step)
            if group.first_error is not None:
                state.errors[group.index] = group.first_error
            if self.passes > 1:
                state.held.append(group)
            if self._logs_samples(ctx.step):
                state.logged.append(group)
        refs = (self.models.ref_logprobs(work.micro_batches, pad_to=work.steps)
                if self.objective.needs_refs(train=train) else None)
        if self.objective.scores_on_arrival and group is not None:  # the batch's statistics need every group
            score = self._scores(state, group, work.micro_batches, refs)
            state.moments[group.index] = self.objective.moments(group, score)
        if train:
            with ctx.timeline.span("train", index=group.index if group is not None else -1):
                state.sums += self._train(work, refs, state, first_pass=True)

    def _logs_samples(self, step: int) -> bool:
        """This step's samples are logged, by each unit's first rank of its last stage, where the loss and
        its advantages run (its tp ranks and stages see the same groups)."""
        unit = self.env.units[self.env.unit_index]
        return self.samples_every > 0 and step % self.samples_every == 0 and self.env.rank == unit[-self.cfg.tp]

    def _scores(self, state: StepState, group: ScoredGroup, mbs, refs) -> torch.Tensor:
        """The objective's advantages of one group (batch scope: its scores), once per step."""
        if group.index not in state.scores:
            state.scores[group.index] = self.objective.scores(
                group, micro_batches=mbs, refs=refs, sampled=lambda idx, like: sampled_logprobs(group, idx, like=like))
        return state.scores[group.index]

    def _train(self, work: Work, refs, state: StepState, *, first_pass: bool,
               mu_scale: tuple[float, float] | None = None) -> LossSums:
        """Forward/backward of one unit of work's micro-batches (then lockstep dummies up to
        `work.steps`); gradients go to the accumulators, sums come back."""
        group, mbs, sums = work.group, work.micro_batches, LossSums()
        linear = self.objective.linear(first_pass=first_pass)
        if group is not None and self.models.computes_loss:  # later passes: the batch's statistics are known by now
            score_G = self.objective.advantages(self._scores(state, group, mbs, refs), mu_scale)
        for k in range(work.steps):
            if k >= len(mbs):  # lockstep padding: weight 0, same forwards and backwards
                self._micro_step(self.models.dummy, None, None, first_pass=first_pass, linear=linear, sums=sums)
                continue
            mb, idx = mbs[k], list(mbs[k].samples)
            # the generator's log-probs, for a loss with a correction against them (tidal/algorithms/corrections.py)
            behaviour = (lambda like, idx=idx: sampled_logprobs(group, idx, like=like)) \
                if self.objective.needs_behaviour else None

            def micro_step(mb=mb, k=k, idx=idx, behaviour=behaviour):
                return self._micro_step(mb, refs[k], score_G[idx], first_pass=first_pass, linear=linear,
                                        sums=sums, behaviour=behaviour)

            # a rank without the loss (an earlier stage) gets None: its backward runs when the gradient comes
            out = self.models.run(mb, micro_step, after_backward=lambda: self._accumulate(Pass.SCORE), old=not first_pass)
            if out is None:
                continue
            logp_NT, mu_NT = out
            if first_pass:  # on-policy check: the trainer recomputes what the generator sampled
                sampled_NT = mu_NT if mu_NT is not None else sampled_logprobs(group, idx, like=logp_NT)
                sums.mismatch.add(logp_NT=logp_NT, sampled_NT=sampled_NT, mask_NT=mb.mask_NT,
                                  fresh_NT=sampled_versions(group, idx, like=logp_NT) == state.step)
        return sums

    def _micro_step(self, mb, ref_NT, score, *, first_pass: bool, linear: bool, sums: LossSums,
                    behaviour=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One micro-batch: policy (and old) forward, then one backward per loss pass. score: the
        advantages of its samples, [N] or per token [N, R]; None: a lockstep dummy, its loss multiplied by 0.
        -> the policy's log-probs, and the generator's where `behaviour` gave them to the loss."""
        # the entropy: a metric of every real micro-batch, with its gradient where the loss has an entropy bonus
        entropy = ("grad" if self.objective.needs_entropy else True) if score is not None else False
        logp_NT, entropy_NT = self.models.policy_logprobs(mb, entropy=entropy)
        if first_pass and score is not None:  # MoE: how often the trainer's own routing would differ
            routed, differs = self.models.routing_counts()
            sums.routed_tokens += routed
            sums.routing_differs += differs
        if entropy_NT is not None:
            sums.entropy_sum += entropy_NT.detach()[mb.mask_NT].sum().item()
            sums.entropy_tokens += mb.mask_NT.sum().item()
        old_NT = self.models.old_logprobs(mb, policy_NT=logp_NT, first_pass=first_pass)
        mu_NT = behaviour(logp_NT) if behaviour is not None else None
        passes = self.objective.passes(score, linear=linear)  # a dummy (score None): the same passes, no advantages
        # FSDP frees the gathered weights after each backward, so a second backward over the same
        # graph would read freed storage: recompute the forward per pass instead of retain_graph
        recompute = self.cfg.fsdp
        for k, (name, adv) in enumerate(passes.items()):
            if k and recompute:
                logp_NT, entropy_NT = self.models.policy_logprobs(mb, entropy=entropy if entropy == "grad" else False)
            if adv is None:
                loss = (logp_NT * 0).sum()
            else:
                out = self.objective.loss(LossInputs(logp_NT=logp_NT, old_logp_NT=old_NT, ref_logp_NT=ref_NT,
                                                     mask_NT=mb.mask_NT, behaviour_logp_NT=mu_NT,
                                                     entropy_NT=entropy_NT if entropy == "grad" else None,
                                                     **_advantages(adv, like=logp_NT)))
                loss = out.loss_sum
                sums.add_loss(name, out)
            self.optim.scaled(loss).backward(retain_graph=not recompute and k < len(passes) - 1)
            self._accumulate(name)
        return logp_NT, mu_NT

    # ---- the barrier ------------------------------------------------------------------------------
    def barrier(self, ctx: StepContext, state: StepState) -> TrainerMetrics:
        """All groups are in: optimizer step(s), then the weights go to the generator."""
        t0 = time.perf_counter()
        with ctx.timeline.span("barrier"):
            self._settle()
            record, digests, errors, versions, mu_scale = self._gather(state)
            steps = []
            if record.groups:  # partial rollouts: a step in which no group ended trains nothing
                steps = [self.optim.step(state.sums, passes=self.objective.first_passes,
                                         combine=self.objective.combine(mu_scale))]
                steps += self._later_passes(state, mu_scale)
            self.optim.end_of_batch()  # the lr schedule follows the run's steps
        if state.logged:
            self._log_samples(state, mu_scale)
        train_s = state.train_s + time.perf_counter() - t0
        t0 = time.perf_counter()
        with ctx.timeline.span("push"):
            ctx.outbound[self.weights].push(self.models.shards(), self.models.specs)
            ctx.outbound[self.weights].flush()
        push_s = time.perf_counter() - t0
        self.offload(ctx)
        return TrainerMetrics.of(record, steps, digests, errors=errors, staleness=_staleness(versions),
                                 train_s=train_s, push_s=push_s, push_bytes=ctx.outbound[self.weights].bytes_per_push,
                                 **self.models.step_figures(),
                                 first_train_t=state.first_train_t, push_end_t=time.time())

    def _log_samples(self, state: StepState, mu_scale) -> None:
        from tidal.executors.trainer.samples import append_samples

        advantages = {g.index: _per_sample(self.objective.advantages(state.scores[g.index], mu_scale), g)
                      for g in state.logged}
        append_samples(self.env.output_dir / "samples.jsonl", state.logged, advantages, self.models.tokenizer)

    def _gather(self, state: StepState):
        """Per-group records, digests, reward errors, policy versions and score moments over dp, once per step."""
        record, parts = state.record, (state.digests, state.errors, state.versions, state.moments)
        if self.units > 1:
            record = record.all_reduce(group=self.models.dp_group)
            gathered = [None] * self.units
            dist.all_gather_object(gathered, parts, group=self.models.dp_group)
            parts = tuple({k: v for rank in gathered for k, v in rank[i].items()} for i in range(len(parts)))
        digests, errors, versions, moments = parts
        return record, digests, errors, versions, self.objective.batch_stats(moments)

    def _later_passes(self, state: StepState, mu_scale) -> list:
        """Mini-batches after the first, and further epochs: all groups are in, in index order,
        ratios against the old-policy snapshot. One optimizer step per mini-batch."""
        steps = []
        for epoch in range(self.cfg.epochs):
            for mini_batch in range(self.cfg.mini_batches):
                if (epoch, mini_batch) == (0, 0):
                    continue
                sums = LossSums()
                mine = sorted((g for g in state.held if self._mini_batch(g.index) == mini_batch),
                              key=lambda g: g.index)
                for work in self._work(mine):
                    refs = self.models.ref_logprobs(work.micro_batches, pad_to=work.steps)
                    sums += self._train(work, refs, state, first_pass=False, mu_scale=mu_scale)
                    self.models.end_of_group()
                self.models.drain()  # every backward in before the step
                steps.append(self.optim.step(sums, passes=(Pass.SCORE,)))
        return steps

    # ---- outputs ------------------------------------------------------------------------------
    def save_checkpoint(self, path: Path, *, step: int) -> None:
        """The policy as an HF directory (what the generator and a user load) and, in trainer/, the
        optimizer (each rank its shard) and the lr schedule. The reference is the initial model and
        the old policy a copy made at each step's start: neither needs saving."""
        self.models.save(path, leader=self.env.is_leader)
        self.optim.save(path / "trainer", group=self.env.group, leader=self.env.is_leader)

    def finalize(self, output_dir: Path) -> None:
        self.models.finalize(output_dir / "final", leader=self.env.is_leader)


def _staleness(versions: dict[int, tuple[int, int, int]]) -> tuple[float, int]:
    """(mean over the model's tokens, max) of how many versions behind the step's weights they were sampled."""
    tokens = sum(n for _, n, _ in versions.values())
    return sum(s for s, _, _ in versions.values()) / max(1, tokens), max((m for *_, m in versions.values()), default=0)


def _advantages(adv: torch.Tensor, *, like: torch.Tensor) -> dict:
    """LossInputs' adv_N (one per sample), or adv_NT (one per token, padded to the group's longest
    response: cut to this micro-batch's T)."""
    adv = adv.to(like)
    return {"adv_N": adv} if adv.dim() == 1 else {"adv_NT": adv[:, : like.shape[1]]}


def _per_sample(adv: torch.Tensor, group: ScoredGroup) -> torch.Tensor:
    """[G] for samples.jsonl: per-token advantages as each response's mean over its model tokens."""
    if adv.dim() == 1:
        return adv
    if group.loss_masks is None:
        return torch.stack([adv[g, : max(1, r.numel())].mean() for g, r in enumerate(group.responses)])
    # a response without a model token (an episode the environment ended at once) trained nothing: 0
    return torch.stack([adv[g, : m.numel()][m].mean() if m.any() else adv.new_zeros(())
                        for g, m in enumerate(group.loss_masks)])
