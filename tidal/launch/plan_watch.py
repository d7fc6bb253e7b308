"""Learning from the run: each step of a run the launch planned (tidal/launch/auto.py) held against the plan's
prediction; a run that strays from it for several steps is told which plan its own rates favour."""
from __future__ import annotations

import sys
from dataclasses import replace

from tidal.launch.auto import OFF_BY, OFF_FOR, Choice, Option, best, predict, rates_at, settings_of, with_layout
from tidal.planner.model import GenRates, TrainRates


def replan(cfg, choice: Choice, *, gen_scale: float = 1.0, train_scale: float = 1.0,
           length: int | None = None) -> list[Option]:
    """The choice's options again, with every generator rate times gen_scale and every trainer rate
    times train_scale (what a run measured against what was predicted), responses `length` long."""
    out = []
    for o in choice.options:
        rates = rates_at(choice.rates, o.threads, placement=o.placement, device=choice.device)
        rates = replace(rates, gen=GenRates(**{k: v * gen_scale for k, v in rates.gen.__dict__.items()}),
                        train=TrainRates(**{k: v * train_scale for k, v in rates.train.__dict__.items()}))
        out.append(predict(with_layout(cfg, replicas=o.replicas, dp=o.dp), rates, placement=o.placement,
                           schedule=o.schedule, slots=o.slots, prompt_len=choice.rates["prompt_len"], ranks=o.ranks,
                           threads=o.threads, length=length))
    return out


class PlanWatch:
    """Compares each step (after the first, which warms up) with the plan's prediction for that step's
    response length (the choice assumed the cap); after OFF_FOR steps in a row more than OFF_BY off,
    says so once, with the plan the run's own rates favour."""

    def __init__(self, cfg, choice: Choice, *, say=lambda line: print(line, file=sys.stderr, flush=True)):
        self.cfg, self.choice, self.say = cfg, choice, say
        self.steps = 0
        self.off: list[tuple[float, float, float]] = []  # (step, gen, train) ratios, measured / predicted
        self.said = False

    def _same(self, o: Option) -> bool:
        p = self.choice.chosen
        return (o.placement, o.schedule, o.slots, o.replicas, o.dp) == (p.placement, p.schedule, p.slots, p.replicas, p.dp)

    def observe(self, *, step_s: float, gen_s: float, train_s: float, length: float | None = None) -> None:
        self.steps += 1
        if self.said or self.steps == 1:
            return
        length = max(1, round(length)) if length else None
        p = next(o for o in replan(self.cfg, self.choice, length=length) if self._same(o))
        ratios = (step_s / p.step_s, gen_s / max(p.gen_s, 1e-9), train_s / max(p.train_s, 1e-9))
        self.off = self.off + [ratios] if abs(ratios[0] - 1) > OFF_BY else []
        if len(self.off) < OFF_FOR:
            return
        self.said = True
        mean = [sum(r[i] for r in self.off) / len(self.off) for i in range(3)]
        found = replan(self.cfg, self.choice, gen_scale=mean[1], train_scale=mean[2], length=length)
        favoured = best(found)
        now = next(o for o in found if self._same(o))
        head = (f"tidal: auto: the last {len(self.off)} steps took {mean[0]:.2f}x the plan's {p.step_s:.3g} s "
                f"(generation {mean[1]:.2f}x, training {mean[2]:.2f}x)")
        if self._same(favoured):
            self.say(f"{head}; with this run's rates the plan still stands ({now.step_s:.3g} s predicted)")
            return
        keys = " ".join(f"--set {k}={v}" for k, v in settings_for(self.cfg, self.choice, favoured).items())
        self.say(f"{head}; with this run's rates {favoured.label()} is faster ({favoured.step_s:.3g} s vs "
                 f"{now.step_s:.3g} s predicted): {keys} for the next run")


def settings_for(cfg, choice: Choice, option: Option) -> dict:
    """The --set values that give `option`, for the keys the choice decided."""
    from tidal.executors.generator.engines import ENGINES

    key = ENGINES.get(cfg.generator.engine).slots_key
    return settings_of(cfg, free=set(choice.settings), slots_key=key, placement=option.placement,
                       schedule=option.schedule, slots=option.slots, replicas=option.replicas, dp=option.dp)
