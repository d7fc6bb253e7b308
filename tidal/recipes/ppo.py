"""PPO with a critic: four executors, one step. The GRPO family's graph with a critic on the path from
the reward to the trainer; the trainer takes the critic's per-token advantages instead of computing
advantages from the rewards.

    global ranks        executor    each step k
    0 .. g-1            generator   wait for the weights of step k-1's barrier; sample G responses per
                                    prompt; each group leaves when its G are done
    next r              reward      score each group as it arrives and send it on
    next c              critic      each scored group as the schedule hands it over: values with the
                                    weights of the step's start, GAE advantages and returns, the group
                                    on to the trainer with an advantage per token; value loss backward.
                                    Then its barrier: the value model's optimizer step(s). Its weights
                                    stay on its ranks.
    next t              trainer     train each group as the schedule hands it over (PPO-clip on the
                                    advantages, whitened over the batch); then the barrier and the push
    g = generator.replicas * generator.tp,  r = reward.replicas,  c = critic.dp * critic.tp,  t = trainer.dp * trainer.cp * trainer.tp * trainer.pp

`torchrun --nproc-per-node 4 launch.py --algo ppo` runs it with one rank each; `examples/ppo_critic.py` builds
the same graph by hand.
"""
from __future__ import annotations

from tidal.executors.critic.executor import Critic
from tidal.recipes import grpo
from tidal.recipes.base import Phase, Recipe

PROMPTS, GENERATE, SCORE, TRAIN, BARRIER, PUSH = grpo.PHASES  # the GRPO step's, around the critic's two
PHASES = (
    PROMPTS, GENERATE, SCORE,
    Phase("values", "critic", Critic.step, "each group as handed over: values, GAE advantages to the trainer"),
    TRAIN,
    Phase("critic barrier", "critic", Critic.barrier, "all groups in: the value model's optimizer step(s)"),
    BARRIER, PUSH,
)


# the GRPO family's graph: the algorithm's advantage source (the critic) puts its stage in (tidal/recipes/advantages.py)
RECIPE = Recipe(name="ppo", build=grpo.build, phases=PHASES + grpo.EVAL_PHASES, derive=grpo.step_figures,
                console=("step", "trainer/reward_mean", "trainer/response_len_mean", "trainer/loss", "critic/value_loss",
                         "critic/explained_variance", "trainer/kl", "trainer/entropy", "trainer/grad_norm",
                         "generator/gen_s", "trainer/train_s", "step_s", "first_group_s", "tpspd", "eval/reward_mean",
                         "eval/pass@1"))
