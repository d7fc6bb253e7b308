"""Environments used by e2e tests through the `module:Class` config path."""
from executors.environments.lookup import Lookup


class BreaksOnSomePrompts(Lookup):
    """The embedded lookup, whose tool is down for one prompt in three (deterministically)."""

    def step(self, turn):
        if sum(map(ord, self.reveal)) % 3 == 0:
            raise RuntimeError("the tool is down")
        return super().step(turn)
