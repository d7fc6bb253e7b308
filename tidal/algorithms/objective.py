"""The objective: everything a trainer step computes that varies by algorithm, behind one object.

The trainer (tidal/executors/trainer/executor.py) streams groups through micro-batches, accumulates
gradients and steps the optimizer; it keeps no algorithm flag and asks its Objective instead:

    needs_reference, needs_behaviour,     the models and inputs the loss reads
    needs_entropy
    scores_on_arrival                     every group's score is needed when it arrives (batch scope)
    needs_refs(train=...)                 whether a unit of work needs the reference's log-probs
    scores(group, ...)                    a group's advantages: [G] per sample, or [G, R] per token
    moments(group, score)                 what a group adds to the batch's statistics (None: nothing)
    batch_stats(moments)                  those statistics once every group is in (the barrier)
    advantages(score, stats)              the exact advantages, given the statistics
    first_passes, passes(score, linear)   the loss passes of a micro-batch and their advantages
    combine(stats)                        how the passes' sums combine at the barrier
    loss(inputs)                          the algorithm's loss of one micro-batch

Everything here is tensor code over one group or one micro-batch; the sums it returns are additive
over micro-batches, groups and data-parallel ranks, which the trainer relies on.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, TypeVar

import torch

from tidal.algorithms.base import Algorithm, AlgoConfig, LossInputs, LossOutput
from tidal.algorithms.batch_scope import (batch_mean_scale, batch_normalise, batch_normalise_at_barrier, linear_passes,
                                    score_moments)
from tidal.algorithms.kl import kl_in_loss, kl_in_reward, kl_penalised_rewards

X = TypeVar("X", torch.Tensor, float)
Stats = tuple[float, float]  # the batch's mean and scale (tidal/algorithms/batch_scope.py)


class Pass(str, Enum):
    """The advantages a loss pass is evaluated at (tidal/algorithms/batch_scope.py): the scores, and for
    batch-scope algorithms also 1 and 0, combined exactly at the barrier."""

    SCORE = "score"
    ONE = "one"
    ZERO = "zero"


@dataclass(frozen=True)
class Objective:
    algorithm: Algorithm
    cfg: AlgoConfig
    # the advantages arrive with each group, one per response token (an AdvantagedGroup: PPO's
    # critic), instead of being computed from its rewards
    token_advantages: bool = False

    def __post_init__(self) -> None:
        if self.algorithm.advantages is None and not self.token_advantages:
            raise ValueError(f"algorithm {self.algorithm.name!r} computes no advantages: they come per token from "
                             f"its advantage source ({self.algorithm.advantage_source!r}); build the trainer with "
                             f"token_advantages=True and an AdvantagedGroup channel into its `scored` port")

    # ---- what it needs ----------------------------------------------------------------------------
    @property
    def needs_reference(self) -> bool:
        return self.cfg.needs_reference

    @property
    def needs_behaviour(self) -> bool:
        return self.cfg.needs_behaviour

    @property
    def needs_entropy(self) -> bool:
        return self.cfg.needs_entropy

    @property
    def scores_on_arrival(self) -> bool:
        """Batch scope: the batch's statistics need every group's score, trained now or later."""
        return self.algorithm.advantage_scope == "batch"

    def needs_refs(self, *, train: bool) -> bool:
        """Reference log-probs: for the loss, or for a KL in the reward the batch's statistics need now."""
        return train or (self.scores_on_arrival and kl_in_reward(self.cfg))

    # ---- advantages -------------------------------------------------------------------------------
    def scores(self, group, *, micro_batches, refs, sampled: Callable) -> torch.Tensor:
        """A group's advantages (batch scope: its scores), [G], or [G, longest response] when they came
        per token with the group. `sampled(idx, like)`: the generator's log-probs of samples idx."""
        if self.token_advantages:
            adv = group.advantages
            if group.loss_masks is not None:  # the environment's tokens carry no advantage, whoever sent the group
                adv = [torch.where(m, a, 0.0) for a, m in zip(adv, group.loss_masks)]
            return torch.nn.utils.rnn.pad_sequence(adv, batch_first=True)
        # the tokens the model wrote (DAPO's overlong penalty): a multi-turn response's observations are not its
        lengths_G = torch.tensor([group.model_tokens(i) for i in range(len(group.responses))])
        rewards_G = self.algorithm.shape_rewards(group.rewards, lengths_G, self.cfg)
        if kl_in_reward(self.cfg):
            rewards_G = rewards_G.clone().to(torch.float64)
            for mb, ref_NT in zip(micro_batches, refs):
                idx = list(mb.samples)
                rewards_G[idx] = kl_penalised_rewards(
                    rewards_N=rewards_G[idx], logp_NT=sampled(idx, ref_NT), ref_logp_NT=ref_NT,
                    mask_NT=mb.mask_NT, cfg=self.cfg)
        return self.algorithm.advantages(rewards_G, self.cfg)

    def moments(self, group, score: torch.Tensor) -> torch.Tensor | None:
        """A group's share of the batch's statistics (per-token scores: over the model's tokens only)."""
        if not self.scores_on_arrival:
            return None
        return score_moments(score if score.dim() == 1 else model_token_advantages(group))

    def batch_stats(self, moments: dict[int, torch.Tensor]) -> Stats | None:
        # no moments: no group ended in the step (partial rollouts), so there is nothing to normalise
        return batch_mean_scale(moments, eps=self.cfg.eps) if self.scores_on_arrival and moments else None

    def advantages(self, score: torch.Tensor, stats: Stats | None) -> torch.Tensor:
        """The exact advantages once the batch's statistics are known (None: the scores are)."""
        return score if stats is None else batch_normalise(score, mu=stats[0], scale=stats[1])

    # ---- loss passes ------------------------------------------------------------------------------
    @property
    def first_passes(self) -> tuple[Pass, ...]:
        """The passes of a batch's first optimizer step: a batch-scope loss at s, 1 (and 0 with a KL in it)."""
        if not self.scores_on_arrival:
            return (Pass.SCORE,)
        return (Pass.SCORE, Pass.ONE) + ((Pass.ZERO,) if kl_in_loss(self.cfg) else ())

    def linear(self, *, first_pass: bool) -> bool:
        """The loss is evaluated at the linear passes (batch scope, first pass: ratio 1)."""
        return self.scores_on_arrival and first_pass

    def passes(self, score: torch.Tensor | None, *, linear: bool) -> dict[Pass, torch.Tensor | None]:
        """{pass: the advantages of a micro-batch's samples}; score None (a lockstep dummy): the same
        passes with no advantages."""
        if score is None:
            return dict.fromkeys(self.first_passes if linear else (Pass.SCORE,))
        if linear:
            return {Pass(name): adv for name, adv in linear_passes(score, self.cfg).items()}
        return {Pass.SCORE: score}

    def combine(self, stats: Stats | None) -> Callable[[dict[Pass, X]], X] | None:
        """How a first step's passes combine at the barrier (gradients and loss sums alike); None: the
        score pass alone."""
        if stats is None:
            return None
        mu, scale = stats
        return lambda at: batch_normalise_at_barrier(at_score=at[Pass.SCORE], at_one=at[Pass.ONE],
                                                     at_zero=at.get(Pass.ZERO), mu=mu, scale=scale)

    def loss(self, inputs: LossInputs) -> LossOutput:
        return self.algorithm.loss(inputs, self.cfg)


def model_token_advantages(group) -> torch.Tensor:
    """A group's per-token advantages at the model's tokens only, concatenated: [sum of model tokens]."""
    if group.loss_masks is None:
        return torch.cat(group.advantages)
    return torch.cat([a[m] for a, m in zip(group.advantages, group.loss_masks)])
