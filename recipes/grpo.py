"""The GRPO family (grpo, dr_grpo, dapo, rloo, reinforce_pp, gspo): three executors, one step.

    global ranks                  executor    each step k
    0 .. g-1                      generator   wait for the weights of step k-1's barrier; sample G
                                              responses per prompt; each group leaves when its G are done
    g .. g+r-1                    reward      score each group as it arrives and send it on
    g+r .. g+r+t-1                trainer     train each group as the schedule hands it over; then
                                              the barrier (optimizer step) and the weight push
    g = generator.replicas * generator.tp,  r = reward.replicas,  t = trainer.dp * trainer.tp

`--dry-run` prints the same with this config's numbers, the channels and the phases below.
"""
from __future__ import annotations

from algorithms.registry import get_algorithm
from channels.channel import Channel
from channels.kinds import Kind
from channels.payloads import GroupVerdict, RolloutGroup, ScoredGroup, WeightsUpdate
from channels.weights import WeightsSender
from controller.graph import Graph
from executors.generator.data import PromptSet
from executors.generator.executor import Generator, GeneratorMetrics
from executors.reward.executor import Reward
from executors.trainer.executor import Trainer
from executors.trainer.stats import TrainerMetrics
from recipes.base import Phase, Recipe
from recipes.checks import check_engine, check_eval, check_tp, check_trainer
from recipes.config import RunConfig

PHASES = (
    Phase("prompts", "generator", PromptSet.prompts, "the step's B prompts: a function of (seed, step, index)"),
    Phase("generate", "generator", Generator.step, "G samples per prompt; a group leaves when its G are done"),
    Phase("score", "reward", Reward.step, "one reward per response, each group as it arrives"),
    Phase("train", "trainer", Trainer.step, "each group as the schedule hands it over: forward, loss, backward"),
    Phase("barrier", "trainer", Trainer.barrier, "all groups in: normalise, clip, optimizer step"),
    Phase("push", "trainer", WeightsSender.push, "trainer shards to generator shards; step k+1 waits for them"),
)


def build(cfg: RunConfig) -> Graph:
    algorithm = get_algorithm(cfg.algo)
    algo_cfg = cfg.algo_config.fit_generation(max_new_tokens=cfg.generator.max_new_tokens)
    dynamic = algo_cfg.filters_groups  # DAPO: flat groups are dropped and the batch topped up
    check_trainer(cfg, dynamic_sampling=dynamic)
    check_tp(cfg)
    check_engine(cfg)
    check_eval(cfg)
    keep = (lambda rewards_G: algorithm.keeps_group(rewards_G, algo_cfg)) if dynamic else None
    executors = [  # placed on contiguous ranks in this order
        generator(cfg, dynamic_sampling=dynamic),
        reward(cfg, keep=keep),
        trainer(cfg, algorithm=algorithm, algo_cfg=algo_cfg),
    ]
    channels = [
        Channel("rollouts", "generator", "reward", Kind.SCATTER, RolloutGroup),
        # scheduled: periodic hands each scored group to the trainer as it lands, sync the whole step
        Channel("scored", "reward", "trainer", Kind.SCATTER, ScoredGroup, scheduled=True),
        WEIGHTS,
    ] + eval_channels(cfg)
    if dynamic:  # verdicts close a same-step cycle: the generator reads them only after each round
        channels.append(Channel("verdicts", "reward", "generator", Kind.BROADCAST, GroupVerdict, feedback=True))
    return Graph(executors, channels)


# lag 1: what the trainer pushes at step k's barrier, the generator receives at step k+1's start
WEIGHTS = Channel("weights", "trainer", "generator", Kind.WEIGHTS, WeightsUpdate)


def generator(cfg: RunConfig, *, dynamic_sampling: bool = False) -> Generator:
    return Generator(config=cfg.generator, model=cfg.generator_model, data=cfg.data, dynamic_sampling=dynamic_sampling,
                     evaluation=cfg.eval)


def reward(cfg: RunConfig, *, keep=None) -> Reward:
    return Reward(config=cfg.reward, functions=cfg.reward_functions, tokenizer_path=cfg.model.path, keep=keep,
                  evaluation=cfg.eval)


def trainer(cfg: RunConfig, *, algorithm, algo_cfg) -> Trainer:
    return Trainer(config=cfg.trainer, model_path=cfg.model.path, dtype=cfg.model.torch_dtype, algorithm=algorithm,
                   algo_config=algo_cfg, temperature=cfg.generator.logprob_temperature, total_steps=cfg.steps,
                   samples_every=cfg.logging.samples_every)


def eval_channels(cfg: RunConfig) -> list[Channel]:
    """Held-out prompts, sampled after the step's rollouts and scored into eval/* metrics."""
    return [Channel("eval", "generator", "reward", Kind.SCATTER, RolloutGroup)] if cfg.eval.every else []


def step_figures(records: dict, world_size: int, run: dict | None = None) -> dict:
    """From the generator's and trainer's records: step_s runs from the start of generation to the
    end of the push; idle fractions are 1 - busy / step_s; overlap_s is how long training ran while
    generation still did. `run` (a dict kept across steps): run_tpspd, the periodic-asynchrony
    paper's whole-run figure: tokens trained since this process's first step, over the time since
    that step began and the devices (ranks)."""
    gen, trn = GeneratorMetrics(**records["generator"]), TrainerMetrics(**records["trainer"])
    step_s = trn.push_end_t - gen.gen_start_t
    figures = {"step_s": step_s, "tpspd": trn.tokens / step_s / world_size,
               "gen_idle_frac": max(0.0, 1 - gen.gen_s / step_s), "train_idle_frac": max(0.0, 1 - trn.train_s / step_s)}
    if run is not None:
        run.setdefault("start_t", gen.gen_start_t)
        run["tokens"] = run.get("tokens", 0) + trn.tokens
        figures["run_tpspd"] = run["tokens"] / (trn.push_end_t - run["start_t"]) / world_size
    if trn.first_train_t:
        figures["first_group_s"] = trn.first_train_t - gen.gen_start_t
        figures["overlap_s"] = max(0.0, gen.gen_end_t - trn.first_train_t)
    return figures


RECIPE = Recipe(name="grpo", build=build, phases=PHASES, derive=step_figures,
                console=("step", "reward_mean", "reward_std", "response_len_mean", "loss", "kl", "entropy", "grad_norm",
                         "gen_s", "train_s", "push_s", "step_s", "first_group_s", "tpspd", "eval/reward_mean",
                         "eval/pass@1"))
