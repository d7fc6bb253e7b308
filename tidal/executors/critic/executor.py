"""The critic: PPO's value function, trained on its own ranks while it hands the trainer advantages.

    step(ctx)            each scored group, as the schedule hands it over: its values with the weights
                         of the step's start, token rewards (with the KL as a reward: the reference's
                         log-probs), GAE advantages and returns; the group goes on to the trainer with
                         an advantage per token, and mini-batch 0's value loss is back-propagated into
                         the accumulators right away
    barrier(ctx, state)  the value loss summed over dp, an optimizer step, later mini-batches and
                         epochs (clipped against the step's start values), the lr schedule

Like the trainer it takes a group the moment it arrives (in index order under tp, in lockstep rounds
under FSDP: tidal/executors/learner/order.py) and accumulates gradients in float64, so sync and periodic
give bit-identical critic weights. Its first pass needs no clip: the values being trained ARE the
step's start values, so clip(V, V_old +- c) = V. Its weights never leave its ranks.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal.algorithms.gae import clipped_value_loss, gae, token_rewards
from tidal.algorithms.kl import masked_kl_NT
from tidal.algorithms.ppo import PPOConfig
from tidal.channels.payloads import AdvantagedGroup, ScoredGroup
from tidal.executors.base import ExecutorEnv, Input, Output, StepContext
from tidal.executors.critic.config import CriticConfig
from tidal.modeling.batching import sampled_logprobs
from tidal.executors.learner.learner import Learner
from tidal.executors.learner.order import Work
from tidal.executors.learner.sums import Sums

VALUE = "value"  # the critic's one loss pass (tidal/modeling/optim.py keys accumulators by pass)


@dataclass
class ValueSums(Sums):
    """Additive over micro-batches, groups and dp ranks: one optimizer step's value loss, and the
    step's values and returns (for their means and the explained variance)."""

    loss: float = 0.0  # 0.5 * (V - R)^2 (or its clipped branch) summed over tokens
    tokens: float = 0.0  # the denominator: value loss is a token mean
    clipped: float = 0.0  # tokens whose clipped branch won
    values: float = 0.0
    returns: float = 0.0
    returns_sq: float = 0.0
    error: float = 0.0  # R - V
    error_sq: float = 0.0
    kl: float = 0.0  # the KL in the reward, summed over tokens



@dataclass
class Held:
    """A group kept for later mini-batches and epochs, with what its first pass computed per micro-batch."""

    group: ScoredGroup
    old_NT: list[torch.Tensor] = field(default_factory=list)  # the step's start values
    returns_NT: list[torch.Tensor] = field(default_factory=list)


@dataclass
class CriticState:
    sums: ValueSums = field(default_factory=ValueSums)  # mini-batch 0's loss, trained as groups arrived
    seen: ValueSums = field(default_factory=ValueSums)  # the step's values and returns, every group
    held: list[Held] = field(default_factory=list)
    train_s: float = 0.0


@dataclass(frozen=True)
class CriticMetrics:
    """The critic's per-step record in metrics.jsonl (its own key names: one row holds every executor's)."""

    value_loss: float  # per token, over the step's optimizer steps
    value_clipfrac: float  # tokens where the clip was active (0 on a first pass)
    explained_variance: float  # 1 - Var(R - V) / Var(R), V the step's start values
    values_mean: float
    returns_mean: float
    reward_kl: float  # the KL per token in the reward (0 without one)
    value_grad_norm: float  # mean over the step's optimizer steps, before clipping
    value_lr: float
    value_train_s: float

    @classmethod
    def of(cls, seen: ValueSums, steps: list[tuple[ValueSums, float, float]], *, train_s: float) -> "CriticMetrics":
        if not steps:  # no group ended in the step (partial rollouts)
            return cls(**dict.fromkeys(("value_loss", "value_clipfrac", "explained_variance", "values_mean",
                                        "returns_mean", "reward_kl", "value_grad_norm", "value_lr"), math.nan),
                       value_train_s=train_s)
        n = max(seen.tokens, 1.0)
        var_r = seen.returns_sq / n - (seen.returns / n) ** 2
        var_e = seen.error_sq / n - (seen.error / n) ** 2
        tokens = sum(s.tokens for s, _, _ in steps)
        return cls(value_loss=sum(s.loss for s, _, _ in steps) / tokens,
                   value_clipfrac=sum(s.clipped for s, _, _ in steps) / tokens,
                   explained_variance=1.0 - var_e / var_r if var_r > 1e-12 else float("nan"),
                   values_mean=seen.values / n, returns_mean=seen.returns / n, reward_kl=seen.kl / n,
                   value_grad_norm=sum(g for _, g, _ in steps) / len(steps), value_lr=steps[-1][2], value_train_s=train_s)


class Critic(Learner):
    scored = Input(ScoredGroup)
    advantaged = Output(AdvantagedGroup)

    def __init__(self, *, name: str = "critic", config: CriticConfig, model_path: str | None, dtype: torch.dtype,
                 algo_config: PPOConfig, temperature: float, total_steps: int):
        """model_path: the policy's initial model (the value model's default start, the KL's reference,
        the tokenizer); temperature: the sampler's, for the reference's log-probs."""
        super().__init__(name=name, config=config)
        self.model_path, self.dtype = model_path, dtype
        self.algo_cfg, self.temperature, self.total_steps = algo_config, temperature, total_steps

    def describe(self):
        return {"dp": self.cfg.dp, "tp": self.cfg.tp, "fsdp": self.cfg.fsdp, "model": self.cfg.path or "the policy's",
                "reference": self.algo_cfg.critic_reference}

    def init(self, env: ExecutorEnv) -> None:
        super().init(env)
        from tidal.executors.critic.model import ValueModels  # model code: on the critic's ranks only
        from tidal.modeling.optim import Optimizer

        start = env.resume / "critic" if env.resume is not None else self.cfg.path or self.model_path
        self.models = ValueModels.build(value_path=None if start is None else str(start), model_path=self.model_path,
                                        dtype=self.dtype, env=env, cfg=self.cfg, temperature=self.temperature,
                                        reference=self.algo_cfg.critic_reference)
        self.optim = Optimizer(self.models.master, compute=self.models.value, cfg=self.cfg.optim, total_steps=self.total_steps,
                               passes=(VALUE,), layout=self.models.grad_layout())
        self._order_sums()
        if env.resume is not None:
            self.optim.load(env.resume / "critic" / "optimizer", group=env.group)

    # ---- the streamed phase -----------------------------------------------------------------
    def step(self, ctx: StepContext) -> CriticState:
        self.onload(ctx)
        state = CriticState()
        for work in self._work(self._in_order(ctx.inbound[self.scored])):  # as the schedule hands them over
            t0 = time.perf_counter()
            with ctx.timeline.span("values", index=work.group.index if work.group is not None else -1):
                with self._summing(work.group):
                    advantages = self._take(work, state)
            if work.group is not None:
                ctx.outbound[self.advantaged].send(AdvantagedGroup(**vars(work.group), advantages=advantages))
            state.train_s += time.perf_counter() - t0
        return state

    def _take(self, work: Work, state: CriticState) -> list[torch.Tensor] | None:
        """Values, advantages and returns of one unit of work (mini-batch 0: also the value loss's
        backward); the group's per-token advantages, or None for a lockstep round without a group."""
        group, train = work.group, work.mini_batch == 0
        refs = self.models.ref_logprobs(work.micro_batches, pad_to=work.steps)
        held = Held(group) if group is not None and self.passes > 1 else None
        advantages = [None] * len(group.responses) if group is not None else None
        for k in range(work.steps):
            if k >= len(work.micro_batches):  # lockstep padding: the same collectives, weight 0
                v_NT = self._forward(self.models.dummy, grad=train)
                self._backward((v_NT * 0).sum() if train else None)
                continue
            mb = work.micro_batches[k]
            idx = list(mb.samples)
            v_NT = self._forward(mb, grad=train)
            old_NT = v_NT.detach()  # the step's start values: the optimizer has not stepped yet
            adv_NT, ret_NT = self._advantages(group, idx, mb.mask_NT, old_NT, refs[k], state)
            for n, i in enumerate(idx):
                advantages[i] = adv_NT[n, : group.responses[i].numel()].float()
            if held is not None:
                held.old_NT.append(old_NT)
                held.returns_NT.append(ret_NT)
            # the first pass trains V against V_old = V itself: the clip cannot act
            self._backward(self._value_loss(v_NT, old_NT, ret_NT, mb.mask_NT, state.sums) if train else None)
        if held is not None:
            state.held.append(held)
        return advantages

    def _forward(self, mb, *, grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            return self.models.values(mb)

    def _backward(self, loss: torch.Tensor | None) -> None:
        """Back-propagate a micro-batch's value loss into the accumulators; None: it was forward-only."""
        if loss is not None:
            loss.backward()
            self._accumulate(VALUE)
        else:
            self.models.no_backward()

    def _advantages(self, group: ScoredGroup, idx: list[int], mask_NT, values_NT, ref_NT, state: CriticState):
        """GAE advantages and returns (float64) of samples `idx`, from the token rewards."""
        kl_NT = None
        if ref_NT is not None:  # the KL of the sampled tokens, towards the initial policy, as a reward
            kl_NT = masked_kl_NT(logp_NT=sampled_logprobs(group, idx, like=ref_NT), ref_logp_NT=ref_NT,
                                 mask_NT=mask_NT, estimator=self.algo_cfg.kl_estimator)
        r_NT = token_rewards(group.rewards[idx], mask_NT, kl_NT=kl_NT, beta=self.algo_cfg.beta)
        adv_NT, ret_NT = gae(r_NT, values_NT, mask_NT, gamma=self.algo_cfg.gamma, lam=self.algo_cfg.lam)
        v_NT, m_NT = values_NT.double(), mask_NT.double()
        state.seen += ValueSums(tokens=float(mask_NT.sum()), values=float((v_NT * m_NT).sum()),
                                returns=float(ret_NT.sum()), returns_sq=float((ret_NT ** 2).sum()),
                                error=float(((ret_NT - v_NT) * m_NT).sum()),
                                error_sq=float((((ret_NT - v_NT) * m_NT) ** 2).sum()),
                                kl=float((kl_NT * m_NT).sum()) if kl_NT is not None else 0.0)
        return adv_NT, ret_NT

    def _value_loss(self, values_NT, old_NT, returns_NT, mask_NT, sums: ValueSums) -> torch.Tensor:
        loss, clipped = clipped_value_loss(values_NT, old_NT, returns_NT, mask_NT, clip=self.algo_cfg.vf_clip)
        sums += ValueSums(loss=loss.item(), tokens=float(mask_NT.sum()), clipped=float(clipped))
        return loss

    # ---- the barrier ------------------------------------------------------------------------------
    def barrier(self, ctx: StepContext, state: CriticState) -> CriticMetrics:
        t0 = time.perf_counter()
        with ctx.timeline.span("barrier"):
            self._settle()
            seen = state.seen.all_reduce(group=self.models.dp_group)
            steps = []
            if seen.tokens:  # partial rollouts: a step in which no group ended trains nothing
                steps = [self._optimizer_step(state.sums)]
                steps += self._later_passes(state)
            self.optim.end_of_batch()
        train_s = state.train_s + time.perf_counter() - t0
        self.offload(ctx)
        return CriticMetrics.of(seen, steps, train_s=train_s)

    def _optimizer_step(self, sums: ValueSums) -> tuple[ValueSums, float, float]:
        sums = sums.all_reduce(group=self.models.dp_group)
        self.optim.reduce_((VALUE,))
        grad_norm, lr = self.optim.apply(self.optim.grads.by_pass[VALUE], denom=sums.tokens)
        return sums, grad_norm, lr

    def _later_passes(self, state: CriticState) -> list[tuple[ValueSums, float, float]]:
        """Mini-batches after the first, and further epochs, once every group is in: in index order,
        the value loss clipped against the step's start values. One optimizer step per mini-batch."""
        steps, held = [], {h.group.index: h for h in state.held}
        for epoch in range(self.cfg.epochs):
            for mini_batch in range(self.cfg.mini_batches):
                if (epoch, mini_batch) == (0, 0):
                    continue
                sums = ValueSums()
                mine = sorted((h.group for h in state.held if self._mini_batch(h.group.index) == mini_batch),
                              key=lambda g: g.index)
                for work in self._work(mine):
                    for k in range(work.steps):
                        if k >= len(work.micro_batches):
                            self._backward((self._forward(self.models.dummy, grad=True) * 0).sum())
                            continue
                        mb, h = work.micro_batches[k], held[work.group.index]
                        v_NT = self._forward(mb, grad=True)
                        self._backward(self._value_loss(v_NT, h.old_NT[k], h.returns_NT[k], mb.mask_NT, sums))
                steps.append(self._optimizer_step(sums))
        return steps

    # ---- outputs ------------------------------------------------------------------------------
    def save_checkpoint(self, path: Path, *, step: int) -> None:
        """critic/: the value model as an HF directory and, in critic/optimizer/, its optimizer (each
        rank its shard) and lr schedule. The reference is the initial policy: nothing to save."""
        self.models.save(path / "critic", leader=self.env.is_leader)
        self.optim.save(path / "critic" / "optimizer", group=self.env.group, leader=self.env.is_leader)

    def finalize(self, output_dir: Path) -> None:
        self.models.save(output_dir / "final" / "critic", leader=self.env.is_leader)
