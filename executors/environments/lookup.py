"""`lookup`: the embedded multi-turn task's environment (`--set rollout=multi_turn` with no data).

The prompt's digit is hidden (executors/embedded/task.py hide_digit: `bo sees ? cups . how many ?
read`). The model's first turn is its look, whatever it writes: the environment answers with the
digit, ` it is 7 . answer:`. From then on a turn with a digit is the answer and ends the episode; a
turn without one looks again. The reward (embedded_lookup) is the embedded reward of the last turn,
paid only after a look, so the digit can only be had through the tool.

Measured on this CPU, the default job (B=8, G=16, 8 tokens a turn), mean reward of the last 10 of
200 steps minus the first 10, with a digit in a turn before any look ending the episode as a guess:
the whole sentence as the answer and `answer:` ending the prompt too: +0.00 (flat); the prompt
ending in `read:` and the short answer: +0.11; `read` (the model's last context token differs from
`answer:`'s `:`): +0.22. With the first turn always a look (this class): +0.26. A tiny model trained
from scratch does not find an exact `<tool_call>` syntax by chance in minutes, hence the lenient
look (the calculator and python environments parse the real format). In every variant the policy
learns to write digits after a look well before it learns to copy the one shown (the embedded
single-turn task's copy emerges after ~100 steps; here, within 300 steps, not yet).
"""
from __future__ import annotations

from executors.environments.base import ENVS, EnvStep, ModelTurn


class Lookup:
    deterministic = True

    def __init__(self, sample: dict):
        if "reveal" not in sample:
            raise ValueError("the lookup environment needs the embedded multi-turn task's rows (a `reveal` "
                             "column); with a data file, name another environment in multi_turn.env")
        self.reveal = sample["reveal"]

    def reset(self) -> None:
        return None

    def step(self, turn: ModelTurn) -> EnvStep:
        if turn.index > 0 and any(c in "0123456789" for c in turn.text):
            return EnvStep(done=True)
        return EnvStep(observation=self.reveal)


ENVS.register("lookup", Lookup)
