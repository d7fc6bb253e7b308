"""Schedules are controller objects; the recipe names the graph and the step's phases in order."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tidal.channels.channel import Channel
from tidal.channels.kinds import Kind
from tidal.controller.graph import Graph
from tidal.controller.schedules import Periodic, Sync, get_schedule
from tidal.controller.world import world_size_of
from tidal.launch.dryrun import describe
from tidal.recipes.base import ROOT
from tidal.recipes.registry import RECIPES, recipe_for
from tests.fixtures import small_config
from tests.toy import Item, Producer, Relay, Sink


def _arrivals(log: list, indices):
    for i in indices:
        log.append(f"in {i}")
        yield SimpleNamespace(index=i)


def test_periodic_hands_each_item_over_as_it_arrives():
    log = []
    for item in Periodic()(_arrivals(log, [2, 0, 1])):
        log.append(f"out {item.index}")
    assert log == ["in 2", "out 2", "in 0", "out 0", "in 1", "out 1"]


def test_sync_collects_the_step_then_hands_over_in_index_order():
    log = []
    for item in Sync()(_arrivals(log, [2, 0, 1])):
        log.append(f"out {item.index}")
    assert log == ["in 2", "in 0", "in 1", "out 0", "out 1", "out 2"]


def test_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="unknown schedule .async.; known: periodic, sync, offpolicy"):
        get_schedule("async")


def test_only_same_step_indexed_channels_can_be_scheduled():
    three = [Producer(), Relay(), Sink()]
    Graph(three, [Channel("items", "producer", "relay", Kind.SCATTER, Item, scheduled=True),
                  Channel("back", "relay", "sink", Kind.GATHER, Item)])
    with pytest.raises(ValueError, match="channel 'back': only a same-step channel .* can be scheduled"):
        Graph([Producer(), Relay(), Sink()],
              [Channel("items", "producer", "relay", Kind.SCATTER, Item),
               Channel("back", "relay", "sink", Kind.GATHER, Item, lag=1, scheduled=True)])


def test_every_algorithm_finds_a_registered_recipe():
    from tidal.algorithms.registry import ALGORITHMS

    assert {recipe_for(name).name for name in ALGORITHMS.names()} <= set(RECIPES.names())
    with pytest.raises(ValueError, match="unknown algo 'nope'"):
        recipe_for("nope")


def test_grpo_recipe_names_what_runs_where_and_in_which_order():
    recipe, cfg = recipe_for("grpo"), small_config(trainer={"dp": 2})
    graph = recipe.build(cfg)
    assert [ex.name for ex in graph.executors] == ["generator", "reward", "trainer"]
    assert [ph.name for ph in recipe.phases] == ["prompts", "generate", "score", "train", "barrier", "push",
                                                 "evaluate", "eval score"]
    assert {ph.executor for ph in recipe.phases[:6]} <= {ex.name for ex in graph.executors}
    # evaluation: guests on the generator's and the reward's ranks, no ranks of their own
    with_eval = recipe.build(small_config(trainer={"dp": 2}, eval={"every": 2}))
    assert {ph.executor for ph in recipe.phases} <= {ex.name for ex in with_eval.executors}
    assert [(ex.name, ex.host.name) for ex in with_eval.executors if ex.host] == [("eval_sampler", "generator"),
                                                                               ("eval", "reward")]
    assert world_size_of(with_eval) == world_size_of(graph)
    # the schedule wraps exactly the trainer's input; the push is the only lagged channel
    assert [ch.name for ch in graph.channels if ch.scheduled] == ["scored"]
    assert [ch.name for ch in graph.channels if ch.step_lag] == ["weights"]
    text = describe(graph, cfg, recipe)
    lines = [line for line in text.splitlines() if line[:2] in {f"{i}." for i in range(1, 7)}]
    assert [line.split()[1] for line in lines] == [ph.name for ph in recipe.phases[:6]]  # evaluation is off
    assert " 2-3 " in lines[3] and "tidal/executors/trainer/executor.py:Trainer.barrier" in lines[4]
    for ph in recipe.phases:  # every phase points at real code
        path, qualname = ph.where.split(":")
        assert f"def {qualname.split('.')[-1]}(" in (ROOT / path).read_text()


def test_ppo_recipe_puts_a_critic_between_reward_and_trainer():
    recipe, cfg = recipe_for("ppo"), small_config("ppo", critic={"dp": 2})
    graph = recipe.build(cfg)
    assert [ex.name for ex in graph.executors] == ["generator", "reward", "critic", "trainer"]
    assert [(ch.name, ch.src, ch.dst, ch.payload.__name__) for ch in graph.channels] == [
        ("rollouts", "generator", "reward", "RolloutGroup"), ("scored", "reward", "critic", "ScoredGroup"),
        ("advantaged", "critic", "trainer", "AdvantagedGroup"), ("weights", "trainer", "generator", "WeightsUpdate")]
    assert [ch.name for ch in graph.channels if ch.scheduled] == ["scored", "advantaged"]  # both learners stream
    assert [ph.name for ph in recipe.phases] == ["prompts", "generate", "score", "values", "train", "critic barrier",
                                                 "barrier", "push", "evaluate", "eval score"]
    text = describe(graph, cfg, recipe, memory="")
    critic = next(line for line in text.splitlines() if line.startswith("critic "))
    assert " 2-3 " in critic and "dp=2" in critic  # critic dp=2 on ranks 2-3, the trainer on 4
    assert next(line for line in text.splitlines() if line.startswith("trainer ")).split()[2] == "4"
    for ph in recipe.phases:
        path, qualname = ph.where.split(":")
        assert f"def {qualname.split('.')[-1]}(" in (ROOT / path).read_text()
    with pytest.raises(ValueError, match=r"critic.mini_batches \(4\) x critic.dp \(2\) exceeds"):
        recipe.build(small_config("ppo", critic={"dp": 2, "mini_batches": 4}))


def test_reward_model_section_adds_a_reward_model_and_a_combiner_on_their_own_ranks():
    """reward.model: the rollouts fan out to the reward and the reward model, both scores meet in the
    combiner, and the combined groups go on where the reward's went (the trainer, or PPO's critic)."""
    from tidal.launch.cli import parser, resolve

    recipe = recipe_for("grpo")
    cfg = resolve(parser().parse_args(["--algo", "grpo", "--set", "reward.model.scale=2",
                                       "--set", "reward.model.replicas=2", "--set", "data.prompts_per_step=4"]))
    assert (cfg.reward.model.scale, cfg.reward.model.replicas, cfg.reward.model.path) == (2.0, 2, None)
    assert cfg.sources["reward.model.scale"] == "--set"
    graph = recipe.build(cfg)
    assert [ex.name for ex in graph.executors] == ["generator", "reward", "reward_model", "combine", "trainer"]
    assert [(ch.name, f"{ch.src}.{ch.out_port}", f"{ch.dst}.{ch.in_port}") for ch in graph.channels] == [
        ("rollouts", "generator.rollouts", "reward.rollouts"),
        ("rollouts_rm", "generator.rollouts", "reward_model.rollouts"),
        ("rule", "reward.scored", "combine.rule"), ("model", "reward_model.scored", "combine.model"),
        ("scored", "combine.scored", "trainer.scored"), ("weights", "trainer.weights", "generator.weights")]
    assert [ch.name for ch in graph.channels if ch.scheduled] == ["scored"]
    # 2 reward-model replicas and 1 combiner on top of the 3 ranks of the default graph
    assert world_size_of(graph) == world_size_of(recipe.build(small_config())) + 3 == 6
    text = describe(graph, cfg, recipe, memory="")
    assert "world size 6" in text and "reward_model.scored -> combine.model" in text
    assert next(line for line in text.splitlines() if line.startswith("reward_model ")).split()[2] == "2-3"
    # an empty section adds the defaults; PPO's critic takes the combined groups
    assert resolve(parser().parse_args(["--algo", "grpo", "--set", "reward.model={}"])).reward.model.scale == 1.0
    ppo = recipe_for("ppo").build(small_config("ppo", reward={"model": {}}))
    assert [(ch.src, ch.dst) for ch in ppo.channels if ch.name == "scored"] == [("combine", "critic")]
    with pytest.raises(ValueError, match=r"reward.model with dynamic sampling \(algorithm.dynamic_sampling=true\) "
                                         r"is not supported: .* would need the combined score"):
        recipe_for("dapo").build(small_config("dapo", reward={"model": {}}, data={"prompts_per_step": 8}))
