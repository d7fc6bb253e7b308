"""The planner's model of partial rollouts (generator.partial_rollout_tokens=N; tidal/executors/generator/partial.py).

Consecutive steps, each replayed as the generator runs it:
- a step's requests are the groups cut in the step before, in (start step, index) order, then its own B prompts;
  a replica takes the groups it started (first index % replicas);
- a group's samples write at most N tokens in a step. A group whose longest sample ends within them leaves for
  the reward and the trainer; one that does not is cut when its rows have written N tokens: its slots free,
  nothing is sent, and the next step resumes it, prefilling each sample's prompt and tokens so far (the
  engine replay's resumed entries, tidal/planner/model.py `replay_engine`);
- a step trains the groups it ended, with every token they wrote over their steps, under the schedule's rules
  (`simulate`: sync waits for all of them, periodic takes each as it comes). A later step calls a carried group
  B x (steps since its start) + its first index, which routes it to trainer unit index % dp.

The model times whole groups by their longest sample, as `simulate` does, and counts a cut at the group's
longest-so-far (its samples decode together). Staleness: a token written j steps before the step that trains it
was sampled by weights j versions old (the run's `staleness_mean` over the model's tokens).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from tidal.planner.model import GenFeatures, Prediction, Rates, StepShape, replay_engine, simulate


@dataclass(frozen=True)
class _Group:
    start: int  # the step that started it
    first: int  # its index in that step
    prompt: int
    lengths: tuple[int, ...]  # its samples' whole lengths
    written: int = 0  # tokens its longest sample wrote before this step


@dataclass(frozen=True, kw_only=True)
class PartialStep:
    """One step's work under partial rollouts: what `simulate` asks of a StepShape."""
    step: int
    B: int
    groups: tuple[_Group, ...]  # resumed ones first, in (start, first) order, then the step's own
    budget: int
    max_batch_prompts: int
    admission: str
    replicas: int
    dp: int
    shared_prompt: bool

    def index(self, g: _Group) -> int:
        return self.B * (self.step - g.start) + g.first

    def ends(self, g: _Group) -> bool:
        return max(g.lengths) - g.written <= self.budget

    def replica_work(self, r: int) -> list[tuple[int, GenFeatures]]:
        mine = [g for g in self.groups if g.first % self.replicas == r]
        prompts = [(self.index(g), g.prompt, len(g.lengths), min(self.budget, max(g.lengths) - g.written), g.written,
                    self.ends(g)) for g in mine]
        return replay_engine(prompts, max_batch_prompts=self.max_batch_prompts, admission=self.admission)

    @property
    def trained(self) -> tuple[int, ...]:
        return tuple(self.index(g) for g in self.groups if self.ends(g))

    @functools.cached_property
    def _by_index(self) -> dict[int, _Group]:
        return {self.index(g): g for g in self.groups}

    def train_work(self, index: int) -> tuple[int, int]:
        g = self._by_index[index]
        prompt = g.prompt * (1 if self.shared_prompt else len(g.lengths))
        return prompt + sum(g.lengths), len(g.lengths)

    def staleness(self) -> tuple[float, int]:
        """(versions summed over the trained response tokens, those tokens)."""
        total = count = 0
        for g in self.groups:
            if not self.ends(g):
                continue
            for n in g.lengths:  # its j-th budget's tokens were written at step start + j
                for j in range(math.ceil(n / self.budget)):
                    chunk = min(n, (j + 1) * self.budget) - j * self.budget
                    total += chunk * (self.step - g.start - j)
                    count += chunk
        return total, count

    def carried(self) -> list[_Group]:
        """The groups this step cuts, as the next step resumes them."""
        return [_Group(g.start, g.first, g.prompt, g.lengths, g.written + self.budget)
                for g in self.groups if not self.ends(g)]


@dataclass(frozen=True)
class PartialPrediction:
    prediction: Prediction  # the step's times; .tokens: the tokens it trains
    groups: int  # the groups it trains
    staleness_mean: float  # versions, over the trained response tokens

    @property
    def step_s(self) -> float:
        return self.prediction.step_s


def partial_steps(shapes: list[StepShape], *, budget: int) -> list[PartialStep]:
    """The steps `shapes` make when each sample writes at most `budget` tokens a step."""
    if budget < 1:
        raise ValueError(f"partial_rollout_tokens must be >= 1, got {budget}")
    out, carried = [], []
    for step, shape in enumerate(shapes):
        own = [_Group(step, i, p, lengths) for i, (p, lengths) in enumerate(zip(shape.prompt_lens, shape.lengths))]
        laid = PartialStep(step=step, B=len(shape.lengths), groups=tuple(carried + own), budget=budget,
                           max_batch_prompts=shape.max_batch_prompts, admission=shape.admission,
                           replicas=shape.replicas, dp=shape.dp, shared_prompt=shape.shared_prompt)
        out.append(laid)
        carried = sorted(laid.carried(), key=lambda g: (g.start, g.first))
    return out


def simulate_partial(shapes: list[StepShape], rates: Rates, *, budget: int, schedule: str) -> list[PartialPrediction]:
    """Consecutive steps of `shapes` (their B prompts each) under partial rollouts and `schedule` (sync | periodic)."""
    out = []
    for laid in partial_steps(shapes, budget=budget):
        total, count = laid.staleness()
        out.append(PartialPrediction(simulate(laid, rates, schedule=schedule), len(laid.trained),
                                     total / count if count else 0.0))
    return out


@dataclass(frozen=True)
class BudgetRow:
    budget: int | None  # None: whole rollouts
    step_s: float  # mean over the steps after the carry filled
    groups: float  # trained a step
    tokens_per_s: float  # trained tokens over the steps' time
    staleness_mean: float


def budget_rows(shapes: list[StepShape], rates: Rates, *, budgets: list[int], schedule: str = "periodic",
                steps: int = 24) -> list[BudgetRow]:
    """Whole rollouts, then each budget: `steps` steps of the shapes cycled, those before a group can have been
    cut its most times (the carry filling) left out."""
    longest = max(n for s in shapes for lengths in s.lengths for n in lengths)
    cycled = [shapes[i % len(shapes)] for i in range(steps)]
    plain = [simulate(s, rates, schedule=schedule) for s in cycled]
    rows = [BudgetRow(None, sum(p.step_s for p in plain) / steps, float(len(shapes[0].lengths)),
                      sum(p.tokens for p in plain) / sum(p.step_s for p in plain), 0.0)]
    for n in budgets:
        fill = math.ceil(longest / n) - 1
        if not 1 <= n < longest or fill >= steps // 2:
            continue
        cut = simulate_partial(cycled, rates, budget=n, schedule=schedule)[fill:]
        time = sum(s.step_s for s in cut)
        rows.append(BudgetRow(n, time / len(cut), sum(s.groups for s in cut) / len(cut),
                              sum(s.prediction.tokens for s in cut) / time,
                              sum(s.staleness_mean * s.prediction.tokens for s in cut) / max(1, sum(s.prediction.tokens for s in cut))))
    return rows
