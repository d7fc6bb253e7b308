"""GRPO with two rewards scoring in parallel (a rule and a reward model), combined, wired by hand.

    torchrun --nproc-per-node 5 examples/two_rewards.py --steps 2 --output-dir runs/two_rewards

One rank each, in this order: generator, reward, reward_model, combine, trainer.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tidal import (  # the names a script needs (tidal/__init__.py)
    Channel, CombineConfig, CombineRewards, DataConfig, Generator, GeneratorConfig, get_algorithm, Graph, Kind,
    ModelConfig, Reporting, Reward, RewardConfig, RewardModel, RewardModelConfig, RolloutGroup, run_job,
    ScoredGroup, Trainer, TrainerConfig, WeightsUpdate,
)


def build_graph(*, steps: int) -> Graph:
    model = ModelConfig()  # path=None: the embedded tiny Qwen3 and its tokenizer
    grpo = get_algorithm("grpo")
    executors = [
        Generator(config=GeneratorConfig(samples_per_prompt=4, max_new_tokens=4, max_batch_prompts=2),
                  model=model, data=DataConfig(prompts_per_step=4)),
        Reward(config=RewardConfig(), functions=["embedded"], tokenizer_path=model.path),
        RewardModel(config=RewardModelConfig(scale=2.0, seed=1)),
        CombineRewards(config=CombineConfig(rule_weight=1.0, model_weight=0.5)),
        Trainer(config=TrainerConfig(micro_batch_size=4), model_path=model.path, dtype=model.torch_dtype,
                algorithm=grpo, algo_config=grpo.config_cls(), temperature=1.0, total_steps=steps),
    ]
    channels = [
        # one output port, two channels: every rollout group goes to both scorers
        Channel("rollouts", "generator", "reward", Kind.SCATTER, RolloutGroup),
        Channel("rollouts_rm", "generator", "reward_model", Kind.SCATTER, RolloutGroup,
                src_port="rollouts", dst_port="rollouts"),
        Channel("rule", "reward", "combine", Kind.SCATTER, ScoredGroup, src_port="scored"),
        Channel("model", "reward_model", "combine", Kind.SCATTER, ScoredGroup, src_port="scored"),
        # scheduled: the run's schedule (periodic by default) decides when the trainer sees each group
        Channel("scored", "combine", "trainer", Kind.SCATTER, ScoredGroup, scheduled=True),
        # lag 1: the generator of step k+1 waits for the weights the trainer pushes at step k's end
        Channel("weights", "trainer", "generator", Kind.WEIGHTS, WeightsUpdate),
    ]
    return Graph(executors, channels)  # validated here: ports, payload types, cycles


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, default=Path("runs/two_rewards"))
    args = p.parse_args()
    try:
        graph = build_graph(steps=args.steps)
        run_job(graph, steps=args.steps, seed=args.seed, output_dir=args.output_dir,
                reporting=Reporting(console_keys=["step", "trainer/reward_mean", "combine/rule_reward_mean", "combine/model_reward_mean",
                              "trainer/loss", "trainer/grad_norm"]))
    except ValueError as exc:  # a wiring or world-size mistake: one line, before any rank blocks
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
