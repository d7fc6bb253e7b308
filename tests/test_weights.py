"""The WEIGHTS push over real ranks: after it, every generator replica holds the trainer's weights
bit for bit, and no generation of the next step started before it."""
from __future__ import annotations

import pytest
import torch

from tidal.modeling.hf import load_model
from tidal.recipes.registry import recipe_for
from tidal.controller.control import Cadence
from tidal.controller.job import run_job
from tidal.channels.payloads import chunk
from tidal.channels.weights import _check_same_model
from tests.fixtures import small_config
from tidal.common.spawn import spawn


def _run(tmp, trainer: dict, generator: dict):
    # a reward with a signal on the untrained model: step 1's update is never zero by the draws' luck
    cfg = small_config(trainer=trainer, generator=generator, reward={"functions": ["tests.rewards:length_parity"]})
    graph = recipe_for(cfg.algo).build(cfg)
    run_job(graph, steps=2, seed=0, output_dir=tmp, cadence=Cadence(every=1), timeout_s=120)
    local = next(ex for ex in graph.executors if ex.env is not None)
    if local.name == "generator":  # this rank's shards, and which tp slice they should be
        env = local.env
        t = env.units[env.unit_index].index(env.rank)
        return {"shards": {n: s.clone() for n, s in local.shards.items()}, "tp": cfg.generator.tp, "t": t,
                "specs": local.specs}
    if local.name == "trainer":  # what it pushes: its local shards under the generator's names
        return {"shards": {n: s.clone() for n, s in local.models.shards().items()}}
    return None


def _slice(full: torch.Tensor, spec, *, tp: int, t: int) -> torch.Tensor:
    if spec.tp_dim is None:
        return full
    start, stop = chunk(full.shape[spec.tp_dim], tp, t)
    return full.narrow(spec.tp_dim, start, stop - start)


# 5 ranks: generator 0-1, reward 2, trainer 3-4
LAYOUTS = {
    "dp2->2 replicas": ({"dp": 2}, {"replicas": 2}),  # each trainer replica feeds one generator replica
    "fsdp2->tp2": ({"dp": 2, "fsdp": True}, {"tp": 2}),  # FSDP row halves into tp column/row shards
    "tp2->2 replicas": ({"tp": 2}, {"replicas": 2}),  # replica 1 fed by replica 0 (relay)
    # megatron's fused qkv / fc1 tp parts, converted on each trainer rank to the torch backend's shards
    "megatron tp2->tp2": ({"tp": 2, "backend": "megatron"}, {"tp": 2}),
    "megatron dp2->2 replicas": ({"dp": 2, "backend": "megatron"}, {"replicas": 2}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_push_reaches_every_generator_rank_bit_identically(tmp_path, layout):
    results = spawn(_run, 5, tmp_path, *LAYOUTS[layout], timeout_s=240)
    # the trainer's step-0 checkpoint, loaded back as an HF model directory
    step0 = dict(load_model(str(tmp_path / "checkpoints/step_000000")).named_parameters())
    for gen in results[0:2]:  # generation of step 1 ran on the weights pushed at the end of step 0
        assert gen["shards"].keys() == step0.keys()
        for name, tensor in step0.items():
            want = _slice(tensor.detach(), gen["specs"][name], tp=gen["tp"], t=gen["t"])
            assert torch.equal(gen["shards"][name], want), name
    trainers = [r["shards"] for r in results[3:5]]
    if "dp2->2 replicas" in layout:
        assert all(torch.equal(trainers[0][n], trainers[1][n]) for n in trainers[0])  # dp replicas agree
        assert any(not torch.equal(trainers[0][n], step0[n]) for n in step0)  # step 1 moved on (not pushed)

def test_a_different_generator_model_is_named_before_any_byte_moves():
    trainer = {"model.norm.weight": [[128], "torch.float32", None], "lm_head.weight": [[512, 128], "torch.float32", 0]}
    _check_same_model(trainer, dict(trainer), channel="weights")  # the same model passes
    other = {**trainer, "model.norm.weight": [[64], "torch.float32", None]}
    with pytest.raises(ValueError, match=r"parameter 'model.norm.weight' is .*\[\[128\].* on the trainer but .*\[\[64\]"):
        _check_same_model(trainer, other, channel="weights")
    with pytest.raises(ValueError, match="differ in parameter names .*generator only: \\['extra'\\]"):
        _check_same_model(trainer, {**trainer, "extra": [[1], "torch.float32", None]}, channel="weights")
