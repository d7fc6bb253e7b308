"""The algorithms `--algo` knows: one `register` line each."""
from __future__ import annotations

from algorithms.base import Algorithm
from algorithms.dapo import DAPO
from algorithms.dr_grpo import DR_GRPO
from algorithms.grpo import GRPO
from algorithms.ppo import PPO
from algorithms.gspo import GSPO
from algorithms.reinforce_pp import REINFORCE_PP
from algorithms.rloo import RLOO
from common.registry import Registry

ALGORITHMS: Registry[Algorithm] = Registry("algo")
ALGORITHMS.register("grpo", GRPO)
ALGORITHMS.register("dr_grpo", DR_GRPO)
ALGORITHMS.register("dapo", DAPO)
ALGORITHMS.register("rloo", RLOO)
ALGORITHMS.register("reinforce_pp", REINFORCE_PP)
ALGORITHMS.register("gspo", GSPO)
ALGORITHMS.register("ppo", PPO)


def get_algorithm(name: str) -> Algorithm:
    return ALGORITHMS.get(name)
