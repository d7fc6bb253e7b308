"""Where the trainer's advantages come from: a registered choice per algorithm (`Algorithm.advantage_source`),
with the config sections it trains with and the stage of the graph it puts between the reward and the trainer.

    rewards   the trainer computes them from each group's rewards (the algorithm's `advantages`)
    critic    a value model on its own ranks (tidal/executors/critic): GAE advantages, one per response
              token, arrive with each group (PPO)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tidal.channels.channel import Channel
from tidal.channels.kinds import Kind
from tidal.channels.payloads import AdvantagedGroup, ScoredGroup
from tidal.common.registry import Registry
from tidal.executors.critic.executor import Critic
from tidal.executors.trainer.executor import Trainer
from tidal.recipes.checks import check_critic
from tidal.recipes.config import RunConfig


@dataclass(frozen=True)
class AdvantageSource:
    per_token: bool  # the advantages arrive with each group (AdvantagedGroup), one per response token
    sections: tuple[str, ...]  # config sections it trains with (their pretrained defaults apply)
    # (cfg, algo_cfg, scored_by=the executor whose output port `scored` sends the scored groups: the reward,
    # or the combiner of a reward model's) -> the executors it adds and the channels from there to the
    # trainer; both learners' inputs are scheduled: periodic hands each group over as it lands, sync the whole step
    stage: Callable[..., tuple[list, list[Channel]]]


def _from_rewards(cfg: RunConfig, algo_cfg, *, scored_by: str = "reward") -> tuple[list, list[Channel]]:
    return [], [Channel("scored", scored_by, "trainer", Kind.SCATTER, ScoredGroup, scheduled=True)]


def _critic(cfg: RunConfig, algo_cfg, *, scored_by: str = "reward") -> tuple[list, list[Channel]]:
    check_critic(cfg)  # its tp: tidal/recipes/grpo.py's check_tp, once for every executor
    critic = Critic(config=cfg.critic, model_path=cfg.model.path, dtype=cfg.model.torch_dtype, algo_config=algo_cfg,
                    temperature=cfg.generator.logprob_temperature, total_steps=cfg.steps)
    return [critic], [
        Channel("scored", scored_by, critic.name, Kind.SCATTER, ScoredGroup, scheduled=True),
        Channel("advantaged", critic.name, "trainer", Kind.SCATTER, AdvantagedGroup, dst_port=Trainer.scored,
                scheduled=True),
    ]


ADVANTAGE_SOURCES: Registry[AdvantageSource] = Registry("advantage source")
ADVANTAGE_SOURCES.register("rewards", AdvantageSource(per_token=False, sections=(), stage=_from_rewards))
ADVANTAGE_SOURCES.register("critic", AdvantageSource(per_token=True, sections=("critic",), stage=_critic))
