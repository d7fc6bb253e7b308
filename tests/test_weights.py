"""The WEIGHTS push over real ranks: after it, every generator replica holds the trainer's weights
bit for bit, and no generation of the next step started before it."""
from __future__ import annotations

import torch

from executors.hf import load_model
from launch.graphs import build_graph
from launch.job import run_job
from tests.dist import spawn
from tests.fixtures import small_config


def _run(tmp, dp: int, replicas: int):
    cfg = small_config(trainer={"dp": dp}, generator={"replicas": replicas})
    graph = build_graph(cfg)
    run_job(graph, steps=2, seed=0, output_dir=tmp, checkpoint_every=1, timeout_s=120)
    local = next(ex for ex in graph.executors if ex.env is not None)
    if local.name == "generator":
        return {n: p.detach().clone() for n, p in local.engine.model.named_parameters()}
    if local.name == "trainer":
        return {n: p.detach().clone() for n, p in local.policy.named_parameters()}
    return None


def test_push_reaches_every_generator_replica_bit_identically(tmp_path):
    # ranks: generator 0-1, reward 2, trainer 3-4 (trainer unit i feeds generator unit i)
    results = spawn(_run, 5, tmp_path, 2, 2, timeout_s=240)
    # the trainer's step-0 checkpoint, loaded back as an HF model directory
    step0 = dict(load_model(str(tmp_path / "checkpoints/step_000000")).named_parameters())
    gens, trainers = results[0:2], results[3:5]
    for gen in gens:  # generation of step 1 ran on the weights pushed at the end of step 0
        assert gen.keys() == step0.keys()
        for name, tensor in step0.items():
            assert torch.equal(gen[name], tensor), name
    assert all(torch.equal(trainers[0][n], trainers[1][n]) for n in trainers[0])  # dp replicas agree
    assert any(not torch.equal(trainers[0][n], step0[n]) for n in step0)  # step 1 moved on (not pushed)
