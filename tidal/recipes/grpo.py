"""The GRPO family (grpo, dr_grpo, dapo, rloo, reinforce_pp, gspo): three executors, one step.

    global ranks                  executor    each step k
    0 .. g-1                      generator   wait for the weights of step k-1's barrier; sample G
                                              responses per prompt; each group leaves when its G are done
    g .. g+r-1                    reward      score each group as it arrives and send it on
    g+r .. g+r+t-1                trainer     train each group as the schedule hands it over; then
                                              the barrier (optimizer step) and the weight push
    g = generator.replicas * generator.tp,  r = reward.replicas,  t = trainer.dp * trainer.cp * trainer.tp * trainer.pp

With `reward.model`, a reward model (reward.model.replicas ranks) scores beside the reward and a
combiner (reward.model.combine_replicas ranks) sums the two before the trainer: reward_stage.

`--dry-run` prints the same with this config's numbers, the channels and the phases below.
"""
from __future__ import annotations

import dataclasses

from tidal.algorithms.registry import get_algorithm
from tidal.channels.channel import Channel
from tidal.channels.kinds import Kind
from tidal.channels.payloads import GroupVerdict, RolloutGroup, ScoredGroup, WeightsUpdate
from tidal.channels.weights import WeightsSender
from tidal.controller.colocate import colocate
from tidal.controller.graph import Graph
from tidal.executors.data import PromptSet
from tidal.executors.evaluation.executor import EvalSampler, EvalScorer
from tidal.executors.generator.executor import Generator, GeneratorMetrics
from tidal.executors.reward.combine import CombineRewards
from tidal.executors.reward.config import CombineConfig
from tidal.executors.reward.executor import Reward
from tidal.executors.reward.model import RewardModel
from tidal.executors.trainer.executor import Trainer
from tidal.executors.trainer.stats import TrainerMetrics
from tidal.recipes.advantages import ADVANTAGE_SOURCES
from tidal.recipes.base import Phase, Recipe
from tidal.recipes.checks import (check_context, check_engine, check_eval, check_lora, check_moe, check_numerics,
                            check_partial, check_placement,
                            check_pipeline, check_rollout, check_tp, check_trainer)
from tidal.recipes.config import RunConfig

PHASES = (
    Phase("prompts", "generator", PromptSet.prompts, "the step's B prompts: a function of (seed, step, index)"),
    Phase("generate", "generator", Generator.step, "G samples per prompt (multi-turn: with an environment's turns); "
          "a group leaves when its G are done"),
    Phase("score", "reward", Reward.step, "one reward per response, each group as it arrives"),
    Phase("train", "trainer", Trainer.step, "each group as the schedule hands it over: forward, loss, backward"),
    Phase("barrier", "trainer", Trainer.barrier, "all groups in: normalise, clip, optimizer step"),
    Phase("push", "trainer", WeightsSender.push, "trainer shards to generator shards; step k+1 waits for them"),
)
# with eval.every > 0, after the generator's and the reward's steps, on their ranks (tidal/executors/evaluation)
EVAL_PHASES = (
    Phase("evaluate", "eval_sampler", EvalSampler.step, "every eval.every steps: the held-out prompts, same weights"),
    Phase("eval score", "eval", EvalScorer.step, "the held-out groups scored into eval/* and eval_samples.jsonl"),
)


def build(cfg: RunConfig) -> Graph:
    """The GRPO family's graph; an algorithm whose advantages come from elsewhere (PPO's critic) gets
    that source's stage between the reward and the trainer (tidal/recipes/advantages.py)."""
    algorithm = get_algorithm(cfg.algo)
    source = ADVANTAGE_SOURCES.get(algorithm.advantage_source)
    algo_cfg = cfg.algo_config.fit_generation(max_new_tokens=cfg.response_tokens)
    dynamic = algo_cfg.filters_groups  # DAPO: flat groups are dropped and the batch topped up
    if dynamic and cfg.schedule.weights_lag > 1:
        raise ValueError("schedule.kind=offpolicy with dynamic sampling (algorithm.dynamic_sampling=true) is not "
                         "supported: the generator runs a step ahead of the reward whose verdicts its top-ups wait "
                         "for; use schedule.max_lag=0 or set algorithm.dynamic_sampling=false")
    check_trainer(cfg, dynamic_sampling=dynamic)
    check_pipeline(cfg, batch_scope=algorithm.advantage_scope == "batch")
    check_context(cfg, critic="critic" in source.sections)
    check_partial(cfg, dynamic_sampling=dynamic)
    check_placement(cfg, critic="critic" in source.sections)
    check_tp(cfg, critic="critic" in source.sections)
    check_moe(cfg, critic="critic" in source.sections)
    check_lora(cfg)
    check_engine(cfg)
    check_numerics(cfg)
    check_rollout(cfg)
    check_eval(cfg)
    keep = (lambda rewards_G: algorithm.keeps_group(rewards_G, algo_cfg)) if dynamic else None
    scorers, to_scorers, scored_by = reward_stage(cfg, keep=keep)
    gen, rew = generator(cfg, dynamic_sampling=dynamic), scorers[0]
    stage, to_trainer = source.stage(cfg, algo_cfg, scored_by=scored_by)
    executors = [  # placed on contiguous ranks in this order
        gen,
        *scorers,
        *stage,
        trainer(cfg, algorithm=algorithm, algo_cfg=algo_cfg, token_advantages=source.per_token),
    ]
    channels = [*to_scorers, *to_trainer, weights_channel(cfg)]
    if dynamic:  # verdicts close a same-step cycle: the generator reads them only after each round
        channels.append(Channel("verdicts", "reward", "generator", Kind.BROADCAST, GroupVerdict, feedback=True))
    guests, eval_channels = evaluation(cfg, generator=gen, reward=rew)
    executors += guests
    if cfg.placement == "colocated":
        executors = colocate(executors)
    return Graph(executors, channels + eval_channels)


def weights_channel(cfg: RunConfig) -> Channel:
    """What the trainer pushes at step k's barrier, the generator receives at step k+1's start, or under
    the offpolicy schedule at step k+1+max_lag's: the schedule sets the lag (tidal/controller/job.py with_schedule)."""
    return Channel("weights", "trainer", "generator", Kind.WEIGHTS, WeightsUpdate)


def generator(cfg: RunConfig, *, dynamic_sampling: bool = False) -> Generator:
    longest = (cfg.eval.max_new_tokens or 0) if cfg.eval.every else 0  # the evaluation samples with this engine
    return Generator(config=cfg.generator, model=cfg.generator_model, data=cfg.data, rollout=cfg.rollout,
                     multi_turn=cfg.multi_turn, dynamic_sampling=dynamic_sampling, longest_response=longest,
                     lora=cfg.trainer.lora)


def reward(cfg: RunConfig, *, keep=None) -> Reward:
    config = cfg.reward
    if cfg.placement == "colocated":  # on every rank of the generator: one replica per rank
        config = config.model_copy(update={"replicas": cfg.generator.replicas * cfg.generator.tp})
    return Reward(config=config, functions=cfg.reward_functions, tokenizer_path=cfg.model.path, keep=keep)


def reward_stage(cfg: RunConfig, *, keep=None) -> tuple[list, list[Channel], str]:
    """What scores the rollouts: the reward alone, or with `reward.model` the reward and a reward model
    side by side, their scores summed per sample by a combiner (as examples/two_rewards.py wires them).
    -> (executors, the reward's first; channels from the generator on; the executor whose `scored` port
    sends the scored groups on to the trainer or the advantage source's stage)."""
    rew = reward(cfg, keep=keep)
    rollouts = Channel("rollouts", "generator", rew.name, Kind.SCATTER, RolloutGroup)
    rm_cfg = cfg.reward.model
    if rm_cfg is None:
        return [rew], [rollouts], rew.name
    if keep is not None:
        raise ValueError("reward.model with dynamic sampling (algorithm.dynamic_sampling=true) is not supported: "
                         "the reward decides which groups to keep from its functions' scores alone, and the "
                         "decision would need the combined score; set algorithm.dynamic_sampling=false or "
                         "leave reward.model unset")
    rm = RewardModel(config=rm_cfg)
    combine = CombineRewards(config=CombineConfig(replicas=rm_cfg.combine_replicas))  # weights: reward.weights, scale
    return [rew, rm, combine], [
        rollouts,  # one output port, two channels: every rollout group goes to both scorers
        Channel("rollouts_rm", "generator", rm.name, Kind.SCATTER, RolloutGroup, src_port=Generator.rollouts,
                dst_port=RewardModel.rollouts),
        Channel("rule", rew.name, combine.name, Kind.SCATTER, ScoredGroup, src_port=Reward.scored),
        Channel("model", rm.name, combine.name, Kind.SCATTER, ScoredGroup, src_port=RewardModel.scored),
    ], combine.name


def trainer(cfg: RunConfig, *, algorithm, algo_cfg, token_advantages: bool = False) -> Trainer:
    return Trainer(config=cfg.trainer, model_path=cfg.model.path, dtype=cfg.model.torch_dtype, numerics=cfg.model.numerics,
                   algorithm=algorithm,
                   algo_config=algo_cfg, temperature=cfg.generator.logprob_temperature, total_steps=cfg.steps,
                   samples_every=cfg.logging.samples_every, token_advantages=token_advantages)


def evaluation(cfg: RunConfig, *, generator: Generator, reward: Reward) -> tuple[list, list[Channel]]:
    """Held-out prompts (eval.every > 0): sampled on the generator's ranks after the step's rollouts,
    scored on the reward's into eval/* metrics; guests of the two, with their own channel."""
    if not cfg.eval.every:
        return [], []
    sampler = EvalSampler(host=generator, config=cfg.eval, data=cfg.data, max_new_tokens=cfg.generator.max_new_tokens)
    scorer = EvalScorer(host=reward, config=cfg.eval)
    return [sampler, scorer], [Channel("eval", sampler.name, scorer.name, Kind.SCATTER, RolloutGroup,
                                       src_port=EvalSampler.held_out, dst_port=EvalScorer.held_out)]


def _own(cls, record: dict):
    """An executor's metrics dataclass from its posted record, which also carries its rank's figures
    (device_peak_gb on an accelerator: tidal/controller/loop.py adds it to every executor's record), or
    posted under names of their own (TrainerMetrics.stats: left out here)."""
    return cls(**{f.name: record[f.name] for f in dataclasses.fields(cls) if f.name in record})


def step_figures(records: dict, world_size: int, run: dict | None = None) -> dict:
    """From the generator's and trainer's records: step_s runs from the start of generation (or the
    end of the previous step's push, if later: the offpolicy schedule generates a step while the
    trainer is still on an earlier one, so step_s is what each step adds to the run) to the end of
    the push; idle fractions are 1 - busy / step_s; overlap_s is how long training ran while
    generation still did. `run` (a dict kept across steps): run_tpspd, the periodic-asynchrony
    paper's whole-run figure: tokens trained since this process's first step, over the time since
    that step began and the devices (ranks)."""
    gen, trn = _own(GeneratorMetrics, records["generator"]), _own(TrainerMetrics, records["trainer"])
    start_t = max(gen.gen_start_t, (run or {}).get("push_end_t", 0.0))
    step_s = trn.push_end_t - start_t
    figures = {"step_s": step_s, "tpspd": trn.tokens / step_s / world_size,
               "gen_idle_frac": max(0.0, 1 - gen.gen_s / step_s), "train_idle_frac": max(0.0, 1 - trn.train_s / step_s)}
    if run is not None:
        run.setdefault("start_t", gen.gen_start_t)
        run["tokens"] = run.get("tokens", 0) + trn.tokens
        figures["run_tpspd"] = run["tokens"] / (trn.push_end_t - run["start_t"]) / world_size
        run["push_end_t"] = trn.push_end_t
    if trn.first_train_t:
        figures["first_group_s"] = max(0.0, trn.first_train_t - start_t)
        figures["overlap_s"] = max(0.0, gen.gen_end_t - trn.first_train_t)
    return figures


RECIPE = Recipe(name="grpo", build=build, phases=PHASES + EVAL_PHASES, derive=step_figures,
                console=("step", "trainer/reward_mean", "trainer/reward_std", "trainer/response_len_mean", "trainer/loss",
                         "trainer/kl", "trainer/entropy", "trainer/grad_norm", "generator/gen_s", "trainer/train_s",
                         "trainer/push_s", "step_s", "first_group_s", "tpspd", "eval/reward_mean", "eval/pass@1"))
