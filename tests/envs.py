"""Environments used by e2e tests through the `module:Class` config path."""
import random
import time

from tidal.executors.environments.base import EnvStep
from tidal.executors.environments.lookup import Lookup


class BreaksOnSomePrompts(Lookup):
    """The embedded lookup, whose tool is down for one prompt in three (deterministically)."""

    def step(self, turn):
        if sum(map(ord, self.reveal)) % 3 == 0:
            raise RuntimeError("the tool is down")
        return super().step(turn)


class SlowLookup(Lookup):
    """The embedded lookup, whose every call takes a random 0-300 ms (unseeded: each run's latencies differ)."""

    inline = False  # a tool's round trip: off the decode loop

    def reset(self):
        time.sleep(random.uniform(0.0, 0.3))
        return super().reset()

    def step(self, turn):
        time.sleep(random.uniform(0.0, 0.3))
        return super().step(turn)


class Unsaveable(Lookup):
    """The embedded lookup, declaring that its state cannot be saved (a live connection, say)."""

    resumable = False


class Tally:
    """An environment whose answers follow its own state (the turns it has seen), so a restore that lost it would
    answer differently (partial rollouts save and restore it at every cut). Its first observation joins the
    prompt; it ends the episode at its fourth turn."""

    deterministic = True
    inline = True

    def __init__(self, sample):
        self.seen = 0

    def reset(self):
        return EnvStep(observation=" read", max_tokens=2)

    def step(self, turn):
        self.seen += 1
        if self.seen == 4 or turn.last:
            return EnvStep(done=True, reward_parts={"seen": float(self.seen)})
        return EnvStep(observation=" it is" + " ." * self.seen, max_tokens=1 + self.seen % 3, reward_parts={"seen": 1.0})
