"""`lookup`: the embedded multi-turn task's environment (`--set rollout=multi_turn` with no data).

The prompt's digit is hidden (tidal/modeling/tiny/task.py hide_digit: `bo sees ? cups . how many ?
read`). The model's first turn is its look: one token, whatever it is (reset() caps the turn at 1),
and the environment answers with the digit, ` it is 7 . answer:`. From then on a turn with a digit is
the answer and ends the episode; a turn without one looks again. The reward (embedded_lookup) is the
embedded reward of the last turn, paid only after a look, so the digit can only be had through the
tool. A tiny model trained from scratch does not find an exact `<tool_call>` syntax by chance in
minutes, hence the lenient look (the calculator and python environments parse the real format).

Why the look is one token: with the look uncapped (up to generator.max_new_tokens, 8), the model's
own words before the reveal change from sample to sample, and a policy trained from scratch learnt
to write digits after the look but not to copy the one shown (+0.26 in 200 steps of the default job,
the last 10 steps' mean reward minus the first 10's). A one-token look makes the context before the
reveal nearly the same for every sample, and the copy is learnt within 200 steps (docs/multi-turn.md,
"The embedded multi-turn task", has the measured curve).
"""
from __future__ import annotations

from tidal.executors.environments.base import ENVS, EnvStep, ModelTurn


class Lookup:
    deterministic = True
    inline = True  # a dictionary read: cheaper on the decode loop than a thread's hand-off (pool.py)

    def __init__(self, sample: dict):
        if "reveal" not in sample:
            raise ValueError("the lookup environment needs the embedded multi-turn task's rows (a `reveal` "
                             "column); with a data file, name another environment in multi_turn.env")
        self.reveal = sample["reveal"]

    def reset(self) -> EnvStep:
        return EnvStep(max_tokens=1)  # the look: one token

    def step(self, turn: ModelTurn) -> EnvStep:
        if turn.index > 0 and any(c in "0123456789" for c in turn.text):
            return EnvStep(done=True)
        return EnvStep(observation=self.reveal)


ENVS.register("lookup", Lookup)
