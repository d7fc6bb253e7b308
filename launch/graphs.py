"""The channel graph of each algorithm family: which executors, which channels."""
from __future__ import annotations

from channels.channel import Channel
from channels.kinds import Kind
from channels.payloads import GroupVerdict, RolloutGroup, ScoredGroup, WeightsUpdate
from algorithms.registry import get_algorithm
from controller.graph import Graph
from executors.generator.executor import Generator
from executors.hf import load_config
from executors.parallel.tp import check_tp
from executors.reward.executor import Reward
from executors.trainer.executor import Trainer
from launch.config import RunConfig


def grpo_graph(cfg: RunConfig) -> Graph:
    """generator -> reward -> trainer, and the trainer's weights back to the generator (lag 1)."""
    stream = cfg.schedule == "periodic"
    if cfg.trainer.mini_batches * cfg.trainer.dp > cfg.data.prompts_per_step:
        raise ValueError(f"trainer.mini_batches ({cfg.trainer.mini_batches}) x trainer.dp ({cfg.trainer.dp}) "
                         f"exceeds data.prompts_per_step ({cfg.data.prompts_per_step}): a mini-batch would be empty")
    _check_placement(cfg)
    algo_config = cfg.algo_config
    if "max_response_tokens" in type(algo_config).model_fields and \
            "max_response_tokens" not in algo_config.model_fields_set:
        # a length normaliser (Dr.GRPO, DAPO) must match what the generator may produce
        algo_config = algo_config.model_copy(update={"max_response_tokens": cfg.generator.max_new_tokens})
    functions = cfg.reward.functions or (["math_verify"] if cfg.data.path else ["embedded"])
    algorithm = get_algorithm(cfg.algo)
    dynamic = bool(getattr(algo_config, "dynamic_sampling", False))
    if dynamic and cfg.trainer.fsdp and cfg.trainer.dp > 1:
        raise ValueError("algorithm.dynamic_sampling with trainer.fsdp and trainer.dp > 1 is not supported: FSDP "
                         "ranks train in rounds of one group each, which needs every prompt index of the batch")
    if dynamic and cfg.trainer.mini_batches > 1:
        raise ValueError("algorithm.dynamic_sampling with trainer.mini_batches > 1 is not supported yet "
                         "(kept prompt indices are not contiguous, so a mini-batch could be empty)")
    keep = (lambda rewards_G: algorithm.keeps_group(rewards_G, algo_config)) if dynamic else None
    executors = [
        Generator(config=cfg.generator, model=cfg.model, data=cfg.data, stream=stream, dynamic_sampling=dynamic),
        Reward(config=cfg.reward, functions=functions, tokenizer_path=cfg.model.path, keep=keep),
        Trainer(config=cfg.trainer, model_path=cfg.model.path, dtype=cfg.model.torch_dtype,
                algorithm=algorithm, algo_config=algo_config,
                temperature=cfg.generator.temperature, stream=stream, total_steps=cfg.steps),
    ]
    channels = [
        Channel("rollouts", "generator", "reward", Kind.SCATTER, RolloutGroup),
        Channel("scored", "reward", "trainer", Kind.SCATTER, ScoredGroup),
        Channel("weights", "trainer", "generator", Kind.WEIGHTS, WeightsUpdate),
    ]
    if dynamic:  # verdicts close a same-step cycle: the generator reads them only after each round
        channels.append(Channel("verdicts", "reward", "generator", Kind.BROADCAST, GroupVerdict, feedback=True))
    return Graph(executors, channels)


def _check_placement(cfg: RunConfig) -> None:
    """tp sizes against the model, before any rank starts (the world size is checked at launch)."""
    sizes = {"trainer.tp": cfg.trainer.tp, "generator.tp": cfg.generator.tp}
    if all(tp == 1 for tp in sizes.values()):
        return
    config = load_config(cfg.model.path)
    for field, tp in sizes.items():
        try:
            check_tp(config, tp=tp)
        except ValueError as exc:
            raise ValueError(f"{field}={tp} does not fit the model: {exc}") from None


def build_graph(cfg: RunConfig) -> Graph:
    # every registered algorithm so far is a GRPO-family policy-gradient graph
    return grpo_graph(cfg)
