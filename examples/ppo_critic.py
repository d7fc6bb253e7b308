"""PPO with a critic, wired by hand: the graph `launch.py --algo ppo` builds (tidal/recipes/ppo.py), as a user
would write it to swap executors for another on-policy algorithm.

    torchrun --nproc-per-node 4 examples/ppo_critic.py --steps 2 --output-dir runs/ppo_critic

One rank each, in this order: generator, reward, critic, trainer. The critic sits between the reward
and the trainer: it turns each scored group into per-token advantages (its values, GAE) and trains
its value model at its own barrier; the trainer takes those advantages instead of computing them.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tidal import (  # the names a script needs (tidal/__init__.py)
    AdvantagedGroup, Channel, Critic, CriticConfig, DataConfig, Generator, GeneratorConfig, get_algorithm,
    Graph, Kind, ModelConfig, Reporting, Reward, RewardConfig, RolloutGroup, run_job, ScoredGroup, Trainer,
    TrainerConfig, WeightsUpdate,
)



def build_graph(*, steps: int) -> Graph:
    model = ModelConfig()  # path=None: the embedded tiny Qwen3 and its tokenizer
    ppo = get_algorithm("ppo")
    algo_cfg = ppo.config_cls()  # gamma 1, lam 0.95, vf_clip 0.2, no KL
    executors = [
        Generator(config=GeneratorConfig(samples_per_prompt=4, max_new_tokens=4, max_batch_prompts=2),
                  model=model, data=DataConfig(prompts_per_step=4)),
        Reward(config=RewardConfig(), functions=["embedded"], tokenizer_path=model.path),
        # the value model starts from the policy's weights (model.path) with a new one-output head
        Critic(config=CriticConfig(), model_path=model.path, dtype=model.torch_dtype, algo_config=algo_cfg,
               temperature=1.0, total_steps=steps),
        # PPO's advantages come per token with each group (its advantage source: the critic)
        Trainer(config=TrainerConfig(), model_path=model.path, dtype=model.torch_dtype, algorithm=ppo,
                algo_config=algo_cfg, temperature=1.0, total_steps=steps, token_advantages=True),
    ]
    channels = [
        Channel("rollouts", "generator", "reward", Kind.SCATTER, RolloutGroup),
        # scheduled: the run's schedule (periodic by default) decides when each learner sees a group
        Channel("scored", "reward", "critic", Kind.SCATTER, ScoredGroup, scheduled=True),
        # the trainer's input port is Trainer.scored; this channel carries the subtype with advantages
        Channel("advantaged", "critic", "trainer", Kind.SCATTER, AdvantagedGroup, dst_port=Trainer.scored,
                scheduled=True),
        # lag 1: the generator of step k+1 waits for the weights the trainer pushes at step k's end
        Channel("weights", "trainer", "generator", Kind.WEIGHTS, WeightsUpdate),
    ]
    return Graph(executors, channels)  # validated here: ports, payload types, cycles


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, default=Path("runs/ppo_critic"))
    args = p.parse_args()
    try:
        graph = build_graph(steps=args.steps)
        run_job(graph, steps=args.steps, seed=args.seed, output_dir=args.output_dir,
                reporting=Reporting(console_keys=["step", "trainer/reward_mean", "trainer/loss", "critic/value_loss", "critic/explained_variance",
                              "trainer/grad_norm"]))
    except ValueError as exc:  # a wiring or world-size mistake: one line, before any rank blocks
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
