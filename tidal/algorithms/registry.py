"""The algorithms `--algo` knows: one `register` line each."""
from __future__ import annotations

from tidal.algorithms.base import Algorithm
from tidal.algorithms.dapo import DAPO
from tidal.algorithms.dr_grpo import DR_GRPO
from tidal.algorithms.grpo import GRPO
from tidal.algorithms.ppo import PPO
from tidal.algorithms.gspo import GSPO
from tidal.algorithms.reinforce_pp import REINFORCE_PP
from tidal.algorithms.rloo import RLOO
from tidal.common.registry import Registry

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
