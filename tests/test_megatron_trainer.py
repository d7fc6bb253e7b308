"""The trainer with trainer.backend=megatron against the torch backend on the same GRPO step, on real
gloo ranks: log-probs, the gradients the optimizer receives, and the weights it pushes, at tp=1,
tp=2 (one model over both ranks) and dp=2 (ZeRO-1 over two replicas); sync and periodic schedules
bit-identical; shared-prompt, varlen and padded rows alike. One spawn of 2 ranks serves every layout. (The whole job under torchrun, and the
push into generator ranks: tests/test_e2e_parallel.py, tests/test_weights.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tidal.algorithms.grpo import GRPOConfig
from tidal.algorithms.registry import get_algorithm
from tidal.channels.payloads import chunk
from tidal.controller.schedules import Periodic, Sync
from tidal.controller.timeline import Timeline
from tidal.executors.base import ExecutorEnv, Endpoints, StepContext
from tidal.modeling.parallel import has_ac
from tidal.executors.trainer.executor import Trainer, TrainerConfig
from tests.fixtures import scored_groups
from tidal.common.spawn import spawn

TOL = 1e-5


class _Pushed:
    bytes_per_push = 0  # what a WEIGHTS port reports (tidal/controller/world.py Outlet)
    def push(self, shards, specs):
        assert shards.keys() <= specs.keys()  # pipeline stages: each its own layers
        self.named = {n: t.detach().clone() for n, t in shards.items()}

    def flush(self):
        pass


def _trainer(env: ExecutorEnv, **layout) -> Trainer:
    # adam_eps=1e-3: Adam's first update stays linear in near-zero gradient entries (tests/test_e2e_parallel.py)
    cfg = TrainerConfig(lr=1e-2, adam_eps=1e-3, grad_clip=0.5, **layout)
    trainer = Trainer(config=cfg, model_path=None, dtype=torch.float32, algorithm=get_algorithm("grpo"),
                      algo_config=GRPOConfig(beta=0.04, clip_low=0.2, clip_high=0.28), temperature=0.9, total_steps=4)
    trainer.init(env)
    return trainer


def _full_grads(trainer: Trainer, seen: dict) -> dict:
    """The optimizer's gradients under HF names, joined over tp (megatron) or as they are (torch)."""
    if trainer.cfg.backend == "torch":
        return seen
    from tidal.modeling.megatron.convert import to_hf, unshard

    parts = [None] * trainer.cfg.tp
    dist.all_gather_object(parts, trainer.models._global(seen), group=trainer.models.tp_group)
    lay = trainer.models.layout
    full = unshard(parts, lay)
    if trainer.models.pipeline is not None:  # every stage's layers
        full = _stages(trainer, full)
    full = to_hf(full, lay)
    return {n: full[n] for n in trainer.models.hf_specs}


def _stages(trainer: Trainer, mine: dict) -> dict:
    """{name: tensor} of every pipeline stage of this rank's unit, joined."""
    stages = [None] * trainer.cfg.pp
    dist.all_gather_object(stages, mine, group=trainer.models.pipeline.group)
    return {k: v for part in stages for k, v in part.items()}


def _run(env: ExecutorEnv, groups, *, schedule=Periodic(), **layout) -> dict:
    """One GRPO step: per-sample log-probs before it, the gradients the optimizer steps on, the push."""
    trainer = _trainer(env, **layout)
    logp, ent = {}, {}
    with torch.no_grad():
        for g in groups if layout.get("pp", 1) == 1 else ():  # stages: the log-probs are the last stage's alone
            for mb in trainer.models.micro_batches(g):
                out = trainer.models.policy_logprobs(mb, entropy=True)
                for n, i in enumerate(mb.samples):
                    logp[g.index, i] = out.logp_NT[n, : g.responses[i].numel()]
                    ent[g.index, i] = out.entropy_NT[n, : g.responses[i].numel()]
    seen, names = {}, {id(p): n for n, p in trainer.models.master.named_parameters()}
    step = trainer.optim.opt.step

    def capture(*args, **kwargs):
        seen.update({names[id(p)]: p.grad.clone() for p in trainer.optim.params})
        return step(*args, **kwargs)

    trainer.optim.opt.step = capture
    pushed = _Pushed()
    ctx = StepContext(step=0, inbound=Endpoints({"scored": schedule(iter(groups))}), outbound=Endpoints({"weights": pushed}),
                      timeline=Timeline(executor="trainer", rank=env.rank))
    metrics = trainer.barrier(ctx, trainer.step(ctx))
    checkpointed = trainer.cfg.backend == "megatron" and has_ac(None, layers=trainer.models.policy.decoder.layers)
    named = _stages(trainer, pushed.named) if getattr(trainer.models, "pipeline", None) is not None else pushed.named
    return {"checkpointed": checkpointed, "logp": logp, "entropy": ent, "grads": _full_grads(trainer, seen), "pushed": named, "specs": trainer.models.specs,
            "grad_norm": metrics.grad_norm, "bubble": metrics.pipeline_bubble, "loss": metrics.loss,
            "mismatch": metrics.logp_mismatch_max}


def _ranks_main(tmp: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, cpu, out = dist.get_rank(), torch.device("cpu"), {}
    single = [dist.new_group([r]) for r in range(2)]  # every rank creates every group, in the same order
    both = dist.new_group([0, 1])
    groups = scored_groups(n=4, G=4)

    def env(ranks, units, group):
        return ExecutorEnv(name="trainer", ranks=ranks, units=units, rank=rank, group=group, device=cpu, seed=0,
                           output_dir=Path(tmp))

    alone = env((rank,), ((rank,),), single[rank])
    out["torch"] = _run(alone, groups, backend="torch")
    out["megatron/tp1"] = _run(alone, groups, backend="megatron")
    for packing in ("on", "off", "padded"):  # shared-prompt rows restart RoPE positions at P (forward.py)
        out[f"megatron/tp1/{packing}"] = _run(alone, groups, backend="megatron", shared_prompt=packing)
    out["megatron/tp2"] = _run(env((0, 1), ((0, 1),), both), groups, backend="megatron", tp=2)
    # the vocabulary-parallel head 4 tokens at a time and each layer checkpointed: recomputed in the
    # backward, collectives and packed attention too
    out["megatron/tp2/chunk4-ac"] = _run(env((0, 1), ((0, 1),), both), groups, backend="megatron", tp=2,
                                         logprob_chunk=4, activation_checkpointing=True)
    mine = [g for g in groups if g.index % 2 == rank]  # group i trains on unit i % dp
    replicas = env((0, 1), ((0,), (1,)), both)
    out["megatron/dp2"] = _run(replicas, mine, backend="megatron", dp=2)
    # the schedules: sync hands groups over after the whole batch, periodic as they come (here: reversed)
    out["megatron/dp2/sync"] = _run(replicas, mine, schedule=Sync(), backend="megatron", dp=2)
    out["megatron/dp2/periodic-reversed"] = _run(replicas, mine[::-1], backend="megatron", dp=2)
    out["megatron/tp2/sync"] = _run(env((0, 1), ((0, 1),), both), groups, schedule=Sync(), backend="megatron", tp=2)
    # pipeline stages: 2 layers each (the model's embedding is tied: a copy on each end)
    out["megatron/pp2"] = _run(env((0, 1), ((0, 1),), both), groups, backend="megatron", pp=2)
    out["megatron/pp2/sync"] = _run(env((0, 1), ((0, 1),), both), groups, schedule=Sync(), backend="megatron", pp=2)
    # later mini-batches and epochs: the old policy's forward goes through the stages beside the policy's
    passes = dict(mini_batches=2, epochs=2)
    out["torch/passes"] = _run(alone, groups, backend="torch", **passes)
    out["megatron/pp2/passes"] = _run(env((0, 1), ((0, 1),), both), groups, backend="megatron", pp=2, **passes)
    dist.barrier()
    return out


def _stages_main(tmp: str):
    """4 ranks: tp=2 x pp=2 in one unit, dp=2 x pp=2, and pp=4 draining after every group."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, cpu, out = dist.get_rank(), torch.device("cpu"), {}
    single = [dist.new_group([r]) for r in range(4)]
    world = dist.new_group([0, 1, 2, 3])
    groups = scored_groups(n=4, G=4)

    def env(units):
        return ExecutorEnv(name="trainer", ranks=(0, 1, 2, 3), units=units, rank=rank, group=world, device=cpu,
                           seed=0, output_dir=Path(tmp))

    out["torch"] = _run(ExecutorEnv(name="trainer", ranks=(rank,), units=((rank,),), rank=rank, group=single[rank],
                                    device=cpu, seed=0, output_dir=Path(tmp)), groups, backend="torch")
    out["megatron/tp2pp2"] = _run(env(((0, 1, 2, 3),)), groups, backend="megatron", tp=2, pp=2)
    mine = [g for g in groups if g.index % 2 == rank // 2]  # units (0, 1) and (2, 3)
    out["megatron/dp2pp2"] = _run(env(((0, 1), (2, 3))), mine, backend="megatron", dp=2, pp=2)
    out["megatron/pp4/group"] = _run(env(((0, 1, 2, 3),)), groups, backend="megatron", pp=4, pp_drain="group")
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(_ranks_main, 2, str(tmp_path_factory.mktemp("megatron_trainer")), timeout_s=600)


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    return spawn(_stages_main, 4, str(tmp_path_factory.mktemp("megatron_stages")), timeout_s=600)


LAYOUTS = ["megatron/tp1", "megatron/tp2", "megatron/tp2/chunk4-ac", "megatron/dp2", "megatron/tp1/on", "megatron/tp1/off", "megatron/tp1/padded"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logprobs_and_entropy_equal_the_torch_backend(ranks, layout):
    for r in ranks:
        ref, got = r["torch"]["logp"], r[layout]["logp"]
        if layout != "megatron/dp2":
            assert got.keys() == ref.keys()
        assert got.keys() <= ref.keys() and got
        worst = max((got[k] - ref[k]).abs().max().item() for k in got)
        assert worst < TOL, (layout, worst)
        ent, ref_ent = r[layout]["entropy"], r["torch"]["entropy"]
        assert max((ent[k] - ref_ent[k]).abs().max().item() for k in ent) < TOL, layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradients_equal_the_torch_backend(ranks, layout):
    for r in ranks:
        ref, got = r["torch"]["grads"], r[layout]["grads"]
        assert got.keys() == ref.keys()
        assert max(g.abs().max().item() for g in ref.values()) > 1e-3  # a real gradient, so the bound can fail
        worst = max((got[n] - g).abs().max().item() for n, g in ref.items())
        assert worst < TOL, (layout, worst)
        assert r[layout]["checkpointed"] == layout.endswith("-ac")
        assert abs(r[layout]["grad_norm"] - r["torch"]["grad_norm"]) < TOL * r["torch"]["grad_norm"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pushed_weights_equal_the_torch_backend(ranks, layout):
    """The push is the torch backend's: the same names and specs, each rank its tp slice."""
    tp = 2 if layout.startswith("megatron/tp2") else 1
    for rank, r in enumerate(ranks):
        ref, got, specs = r["torch"]["pushed"], r[layout]["pushed"], r[layout]["specs"]
        assert got.keys() == ref.keys() and specs == r["torch"]["specs"]
        worst = 0.0
        for name, full in ref.items():
            dim = specs[name].tp_dim
            want = full if tp == 1 or dim is None else full.narrow(dim, *_span(full.shape[dim], tp, rank))
            worst = max(worst, (got[name] - want).abs().max().item())
        assert worst < TOL, (layout, worst)


def _span(size: int, parts: int, part: int) -> tuple[int, int]:
    start, stop = chunk(size, parts, part)
    return start, stop - start


@pytest.mark.parametrize("periodic, other", [("megatron/dp2", "megatron/dp2/sync"),
                                             ("megatron/dp2", "megatron/dp2/periodic-reversed"),
                                             ("megatron/tp2", "megatron/tp2/sync")])
def test_sync_and_periodic_push_the_same_bits(ranks, periodic, other):
    for r in ranks:
        base = r[periodic]["pushed"]
        assert base.keys() == r[other]["pushed"].keys()
        assert all(torch.equal(base[n], r[other]["pushed"][n]) for n in base)


PIPELINES = {"megatron/pp2": 1, "megatron/tp2pp2": 2, "megatron/dp2pp2": 1, "megatron/pp4/group": 1}  # layout: tp


@pytest.mark.parametrize("layout", list(PIPELINES))
def test_pipeline_stages_train_as_one_rank(ranks, stages, layout):
    """trainer.pp: the gradients AdamW steps on (every stage's, joined), the gradient norm and the pushed
    weights (each stage its own layers; joined: the whole model, each tp rank its slice) equal the torch
    backend's one-rank step within 1e-5; the bubble is a fraction."""
    runs = ranks if layout == "megatron/pp2" else stages
    tp = PIPELINES[layout]
    for rank, r in enumerate(runs):
        ref, got = r["torch"], r[layout]
        assert got["grads"].keys() == ref["grads"].keys()
        worst = max((got["grads"][n] - g).abs().max().item() for n, g in ref["grads"].items())
        assert worst < TOL, (layout, worst)
        assert abs(got["grad_norm"] - ref["grad_norm"]) < TOL * ref["grad_norm"]
        assert abs(got["loss"] - ref["loss"]) < TOL and abs(got["mismatch"] - ref["mismatch"]) < TOL
        assert 0 < got["bubble"] < 1 and ref["bubble"] is None
        assert got["pushed"].keys() == ref["pushed"].keys()
        for name, full in ref["pushed"].items():
            dim = got["specs"][name].tp_dim
            want = full if tp == 1 or dim is None else full.narrow(dim, *_span(full.shape[dim], tp, rank % tp))
            assert (got["pushed"][name] - want).abs().max().item() < TOL, (layout, name)


def test_pipeline_stages_train_later_mini_batches_and_epochs_as_one_rank(ranks):
    """mini_batches=2 x epochs=2 (four optimizer steps, three of them against the old-policy snapshot,
    whose forward travels the stages too) at pp=2: the weights pushed after them equal the torch
    backend's one-rank run."""
    for r in ranks:
        ref, got = r["torch/passes"]["pushed"], r["megatron/pp2/passes"]["pushed"]
        assert got.keys() == ref.keys()
        moved = max((ref[n] - r["torch"]["pushed"][n]).abs().max().item() for n in ref)
        assert moved > 1e-4  # the later steps moved the weights past the first step's
        worst = max((got[n] - ref[n]).abs().max().item() for n in ref)
        assert worst < TOL, worst


def test_pipeline_sync_and_periodic_push_the_same_bits(ranks):
    for r in ranks:
        base, other = r["megatron/pp2"]["pushed"], r["megatron/pp2/sync"]["pushed"]
        assert base.keys() == other.keys() and all(torch.equal(base[n], other[n]) for n in base)
