"""Environments used by e2e tests through the `module:Class` config path."""
import random
import time

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
