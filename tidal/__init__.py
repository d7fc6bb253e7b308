"""Tidal: on-policy RL for LLMs with periodic asynchrony (docs/architecture.md).

Everything Tidal installs lives under this one name: tidal.launch (the command line, jobs from Python),
tidal.recipes (the graphs of the algorithms), tidal.controller, tidal.executors, tidal.modeling,
tidal.channels, tidal.algorithms, tidal.planner, tidal.common.

The names a user's script needs are here too, imported on first use (`import tidal` loads no torch):

    tidal.run("grpo", steps=50)                  # a job, as `tidal --algo grpo` runs it (docs/python.md)
    tidal.Graph([...executors], [...channels])   # a graph of one's own, run by tidal.run_job
"""
from __future__ import annotations

import importlib

# name -> the module that defines it
_API = {
    **dict.fromkeys(("run", "start", "command", "JobFailed"), "tidal.launch.jobs"),
    "Graph": "tidal.controller.graph",
    "run_job": "tidal.controller.job",
    "Reporting": "tidal.controller.report",
    "Channel": "tidal.channels.channel",
    "Kind": "tidal.channels.kinds",
    **dict.fromkeys(("RolloutGroup", "ScoredGroup", "AdvantagedGroup", "WeightsUpdate"), "tidal.channels.payloads"),
    "get_algorithm": "tidal.algorithms.registry",
    **dict.fromkeys(("DataConfig", "GeneratorConfig", "ModelConfig"), "tidal.executors.generator.config"),
    "Generator": "tidal.executors.generator.executor",
    "Reward": "tidal.executors.reward.executor",
    **dict.fromkeys(("RewardConfig", "RewardModelConfig", "CombineConfig"), "tidal.executors.reward.config"),
    "RewardModel": "tidal.executors.reward.model",
    "CombineRewards": "tidal.executors.reward.combine",
    **dict.fromkeys(("Trainer", "TrainerConfig"), "tidal.executors.trainer.executor"),
    "Critic": "tidal.executors.critic.executor",
    "CriticConfig": "tidal.executors.critic.config",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'tidal' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # once: the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
