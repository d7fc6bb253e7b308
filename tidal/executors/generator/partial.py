"""Partial rollouts (`generator.partial_rollout_tokens=N`; LlamaRL §4.2, after Kimi k1.5): in a step,
each sample writes at most N tokens. A group whose samples have not all ended by then is cut: its
tokens, log-probs and the policy version of every token are kept here, and it is resumed in the
next step, with the weights of that step, until all its samples end; only then is it scored and
trained. A long tail then holds up no step, at the price of samples written by several policy
versions (their tokens' versions travel with the group; metrics' staleness counts them).

Which step trains a group is fixed by token counts alone, never by timing: sync and periodic (and
any number of replicas) cut and resume the same groups. A group keeps the seeds of the step that
started it; in a later step it takes index B * (steps since its start) + its first index, unique
because a group is cut at most ceil(its longest response / N) - 1 times. Each replica resumes the groups
it started (index % replicas), so a replica keeps its own; a checkpoint keeps every replica's (one
file each), and a resume with another replica count shares them out by the same rule.

Multi-turn episodes are cut the same way (each sample writes at most N tokens a step; an observation is fed,
not written). A cut episode stops within a turn or after its turn's answer, and its group carries each
sample's state: where its turn began, whether its episode is over, its loss mask, and the episode itself with
its environment saved (tidal/executors/environments/base.py save_env). The next step restores them from that
saved state whether or not a checkpoint came between, so a resumed run is the uninterrupted one by
construction (tests/test_partial_rollouts.py checks it bit for bit).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from tidal.channels.payloads import RolloutGroup
from tidal.executors.data import PromptRow
from tidal.executors.generator.contract import GroupCompletion, Resume, SamplingParams
from tidal.executors.generator.rollouts import Rollout, rollout_group

Prompt = tuple[int, PromptRow, list[int]]  # (index in the step, data row, token ids)


@dataclass(frozen=True)
class Carried:
    """A cut group, waiting for the next step."""
    resume: Resume  # its start (step, index), tokens, log-probs and ended samples
    versions: list[torch.Tensor]  # G x [R_i] int32: the policy version that sampled each token
    row: PromptRow
    prompt_ids: list[int]  # multi-turn: with the first observation (reset()'s)
    episodes: list[dict] | None = None  # multi-turn: each sample's episode as saved at the cut (rollouts.py)


def max_cuts(*, response_tokens: int, budget: int) -> int:
    """How many times one group can be cut: the most steps a sample spans, less one."""
    return math.ceil(response_tokens / budget) - 1


class PartialRollouts:
    """One replica's cut groups, step by step; a step's rollout (either: its `complete`) under partial rollouts."""

    def __init__(self, *, rollout: Rollout, prompts_per_step: int, unit: int, units: int, budget: int):
        self.rollout, self.B, self.unit, self.units, self.budget = rollout, prompts_per_step, unit, units, budget
        self.carried: list[Carried] = []  # in (start step, index) order
        self._after: dict[int, list[Carried]] = {}  # the carry after each recent step, for its checkpoint
        self._resumed: dict[int, Carried] = {}  # this step's: {index in the step: carried group}
        self._cut: list[Carried] = []
        self.written_tokens = 0  # this step's, by the groups it ended and those it cut

    def index(self, carried: Carried, step: int) -> int:
        return self.B * (step - carried.resume.step) + carried.resume.index

    def run(self, engine, prompts: list[Prompt], params: SamplingParams, *, step: int, stop,
            version: int) -> Iterator[RolloutGroup]:
        """The step's groups: those cut in the step before first (resumed: their seeds and tokens kept),
        then `prompts`; every sample writes at most `budget` tokens. A group whose samples all ended comes
        out, each token's policy version with it (`version`: this step's weights'); one cut again is kept."""
        self._resumed = {self.index(c, step): c for c in self.carried}
        self._cut, self.written_tokens = [], 0
        rows = {i: c.row for i, c in self._resumed.items()} | {i: row for i, row, _ in prompts}
        for done, extras in self.rollout.complete(engine, prompts, params, step=step, stop=stop, budget=self.budget,
                                                  resumed=self._resumed):
            self.written_tokens += self.written(done.index, done.response_ids)
            if done.cut:  # the next step resumes it
                self.cut(done, row=rows[done.index], step=step, version=version, **extras)
                continue
            group = rollout_group(step, rows[done.index], done, **extras)
            group.versions = self.versions(done.index, done.response_ids, version)
            yield group

    def versions(self, index: int, responses: list[torch.Tensor], version: int) -> list[torch.Tensor]:
        """Each token's policy version: a resumed group's earlier tokens keep theirs, the rest are `version`'s."""
        before = self._resumed[index].versions if index in self._resumed else [torch.zeros(0, dtype=torch.int32)] * len(responses)
        return [torch.cat([v, torch.full((r.numel() - v.numel(),), version, dtype=torch.int32)])
                for v, r in zip(before, responses)]

    def written(self, index: int, responses: list[torch.Tensor]) -> int:
        """Tokens the step's group `index` wrote in this step."""
        before = self._resumed[index].resume.response_ids if index in self._resumed else []
        return sum(r.numel() for r in responses) - sum(r.numel() for r in before)

    def origin(self, index: int, step: int) -> tuple[int, int]:
        """(start step, first index) of the step's group `index`."""
        c = self._resumed.get(index)
        return (c.resume.step, c.resume.index) if c is not None else (step, index)

    def cut(self, done: GroupCompletion, *, row: PromptRow, step: int, version: int,
            episodes: list[dict] | None = None) -> None:
        start, first = self.origin(done.index, step)
        self._cut.append(Carried(
            resume=Resume(step=start, index=first, response_ids=done.response_ids, logprobs=done.logprobs,
                          finished_G=done.finished_G, loss_masks=done.loss_masks, over_G=done.over_G,
                          turn_starts=done.turn_starts),
            versions=self.versions(done.index, done.response_ids, version), row=row,
            prompt_ids=[int(t) for t in done.prompt_ids_P], episodes=episodes))

    def end(self, step: int) -> None:
        """The step is done: its cut groups wait for the next one."""
        self.carried = sorted(self._cut, key=lambda c: (c.resume.step, c.resume.index))
        self._after[step] = self.carried
        for old in [s for s in self._after if s < step - 2]:
            del self._after[old]

    @property
    def resumed(self) -> int:
        return len(self._resumed)

    # -- checkpoints --------------------------------------------------------------------------------

    def save(self, path: Path, *, step: int) -> None:
        """The groups cut by step `step` (this replica's), as plain tensors, ints, strings and bytes."""
        path.mkdir(parents=True, exist_ok=True)
        groups = [{"step": c.resume.step, "index": c.resume.index, "response_ids": c.resume.response_ids,
                   "logprobs": c.resume.logprobs, "finished": c.resume.finished_G, "versions": c.versions,
                   "prompt_ids": c.prompt_ids, "loss_masks": c.resume.loss_masks, "over": c.resume.over_G,
                   "turn_starts": c.resume.turn_starts, "episodes": c.episodes}
                  for c in self._after[step]]
        torch.save({"groups": groups}, path / f"partial_rollouts.unit{self.unit}.pt")

    def load(self, path: Path, *, prompt_of) -> None:
        """The cut groups of a checkpoint (every replica's file) that this replica resumes;
        `prompt_of(step, index)`: the (row, token ids) of that step's prompt, as the data gives it."""
        groups = []
        for file in sorted(path.glob("partial_rollouts.unit*.pt")):
            saved = torch.load(file, weights_only=True)
            groups += [g for g in saved["groups"] if g["index"] % self.units == self.unit]
        carried = []
        for g in groups:
            row, ids = prompt_of(g["step"], g["index"])
            carried.append(Carried(resume=Resume(step=g["step"], index=g["index"], response_ids=g["response_ids"],
                                                 logprobs=g["logprobs"], finished_G=g["finished"],
                                                 loss_masks=g.get("loss_masks"), over_G=g.get("over"),
                                                 turn_starts=g.get("turn_starts")),
                                   versions=g["versions"], row=row, prompt_ids=g.get("prompt_ids", ids),
                                   episodes=g.get("episodes")))
        self.carried = sorted(carried, key=lambda c: (c.resume.step, c.resume.index))
