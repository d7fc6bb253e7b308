"""The resharding weight push: the plan (pure, every tp ratio, with and without FSDP) and real pushes
between real parallelized HF models on gloo ranks, checked bit for bit."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, Qwen3Config

from tidal.channels.payloads import ParamSpec, chunk, hf_layers, hf_stage
from tidal.channels.push import WeightPush
from tidal.channels.push_plan import GeneratorLayout, TrainerLayout, build_plan
from tidal.modeling.parallel import build_mesh, local, param_specs, parallelize
from tests.names import FUSED, IDENTITY, targets
from tidal.common.spawn import spawn


def qwen3(*, heads: int = 4, kv: int = 2, hidden: int = 32, inter: int = 64, vocab: int = 96, seed: int = 0,
          meta: bool = False):
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=8, intermediate_size=inter, max_position_embeddings=64,
                         tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)


# tp up to 4 on both sides; hidden 38 makes FSDP's dim-0 chunks uneven (10, 10, 10, 8)
SPECS = param_specs(qwen3(heads=8, kv=4, hidden=38, inter=72, vocab=100, meta=True))


# ---- the plan, pure -----------------------------------------------------------------------------
def simulate(plan, full: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Carry out `plan` in memory: every stream's buckets, relays included, in order."""
    tr, gen = plan.trainer, plan.generator
    shards = {}
    layers = hf_layers(plan.specs)
    for d, st, t in itertools.product(range(tr.dp), range(tr.pp), range(tr.tp)):  # a stage holds its own layers
        shards[tr.rank(d, t, st)] = {n: full[n][tuple(slice(a, b) for a, b in tr.box(s, d=d, t=t))]
                                     for n, s in plan.specs.items() if hf_stage(n, layers=layers, pp=tr.pp) == st}
    counts = {}
    for k, t in itertools.product(range(gen.replicas), range(gen.tp)):
        shards[gen.rank(k, t)] = {n: torch.full([b - a for a, b in gen.box(s, t=t)], float("nan"))
                                  for n, s in plan.specs.items()}
        counts[gen.rank(k, t)] = {n: torch.zeros_like(x) for n, x in shards[gen.rank(k, t)].items()}
    received: dict[int, list] = {}
    for s in plan.streams:  # streams are listed direct first, then each relay after its upstream
        if s.sender == s.origin:
            payload = [(plan.pieces[i], shards[s.origin][plan.pieces[i].name][_sl(plan.pieces[i].src_slice)].clone())
                       for b in s.buckets for i, _ in b.entries]
        else:
            payload = [x for x in received[s.sender] if x[2] == s.origin]
        for p, value, *_ in payload:
            assert p.src == s.origin and p.dst == s.head
            shards[s.receiver][p.name][_sl(p.dst_slice)] = value
            counts[s.receiver][p.name][_sl(p.dst_slice)] += 1
        received.setdefault(s.receiver, []).extend((p, v, s.origin) for p, v, *_ in payload)
    return {r: (shards[r], counts[r]) for r in gen.ranks}


def _sl(box):
    return tuple(slice(a, b) for a, b in box)


def zero_copy_piece(piece) -> bool:
    """No copy on either side."""
    return piece.src_direct and piece.dst_direct


def bytes_sent(plan) -> dict[int, int]:
    out: dict[int, int] = {}
    for s in plan.streams:
        out[s.sender] = out.get(s.sender, 0) + sum(b.nbytes for b in s.buckets)
    return out


def arange_weights(specs):
    out, start = {}, 0
    for n, s in specs.items():
        numel = math.prod(s.shape)
        out[n] = torch.arange(start, start + numel, dtype=torch.float64).view(s.shape)
        start += numel
    return out


@pytest.mark.parametrize("zero_copy", [None, 1024])
@pytest.mark.parametrize("tp_t,tp_g,fsdp", list(itertools.product((1, 2, 4), (1, 2, 4), (False, True))))
def test_plan_covers_every_generator_element_once(tp_t, tp_g, fsdp, zero_copy):
    trainer = TrainerLayout(ranks=tuple(range(2 * tp_t)), tp=tp_t, fsdp=fsdp)  # dp = 2
    gen = GeneratorLayout(ranks=tuple(range(100, 100 + 3 * tp_g)), tp=tp_g)  # 3 replicas: one is relayed
    bucket = 4096
    plan = build_plan(specs=SPECS, trainer=trainer, generator=gen, bucket_bytes=bucket, zero_copy_min_bytes=zero_copy)
    assert any(map(zero_copy_piece, plan.pieces)) == (zero_copy is not None)
    if zero_copy is not None and tp_t != tp_g:  # a row block on one side is a column block on the other
        assert any(p.src_direct != p.dst_direct for p in plan.pieces)
    full = arange_weights(SPECS)
    for rank, (shards, counts) in simulate(plan, full).items():
        t = gen.ranks.index(rank) % tp_g
        for n, spec in SPECS.items():
            assert torch.equal(counts[n], torch.ones_like(counts[n])), (rank, n)  # exactly once
            assert torch.equal(shards[n], full[n][_sl(gen.box(spec, t=t))]), (rank, n)
    # no piece larger than a bucket, nor than the trainer shard it comes from or the shard it fills
    for p in plan.pieces:
        spec = SPECS[p.name]
        d, t = divmod(trainer.ranks.index(p.src), tp_t)
        t_numel = math.prod(b - a for a, b in trainer.box(spec, d=d, t=t))
        g_numel = math.prod(b - a for a, b in gen.box(spec, t=gen.ranks.index(p.dst) % tp_g))
        assert p.numel <= min(t_numel, g_numel) and p.nbytes <= bucket
    assert all(b.nbytes <= bucket + 16 for s in plan.streams for b in s.buckets)
    # the trainer cuts pieces once per replica it feeds (one per full copy it holds); further
    # replicas are fed replica to replica
    direct = min(gen.replicas, trainer.copies)
    per_replica = sum(math.prod(s.shape) * 4 * (tp_g if s.tp_dim is None else 1) for s in SPECS.values())
    assert sum(p.nbytes for p in plan.pieces) == direct * per_replica
    relays = [s for s in plan.streams if s.sender not in trainer.ranks]
    assert bool(relays) == (gen.replicas > direct)


@pytest.mark.parametrize("tp_t,tp_g", list(itertools.product((1, 2), (1, 2))))
def test_plan_with_pipeline_stages_sends_each_layer_from_its_stage(tp_t, tp_g):
    """trainer.pp=2 (dp=2): every generator element exactly once, each piece from a rank of the stage
    that holds its parameter (simulate() gives a rank its stage's parameters alone), both dp units sending."""
    trainer = TrainerLayout(ranks=tuple(range(2 * 2 * tp_t)), tp=tp_t, pp=2)  # dp = 2
    gen = GeneratorLayout(ranks=tuple(range(100, 100 + 2 * tp_g)), tp=tp_g)
    plan = build_plan(specs=SPECS, trainer=trainer, generator=gen, bucket_bytes=4096)
    full = arange_weights(SPECS)
    for rank, (shards, counts) in simulate(plan, full).items():
        t = gen.ranks.index(rank) % tp_g
        for n, spec in SPECS.items():
            assert torch.equal(counts[n], torch.ones_like(counts[n])), (rank, n)
            assert torch.equal(shards[n], full[n][_sl(gen.box(spec, t=t))]), (rank, n)
    stage_of = {trainer.rank(d, t, s): s for d in range(2) for s in range(2) for t in range(tp_t)}
    assert {stage_of[p.src] for p in plan.pieces if p.name.startswith("model.layers.1.")} == {1}
    assert {stage_of[p.src] for p in plan.pieces if p.name == "model.embed_tokens.weight"} == {0}
    assert {(p.src // (2 * tp_t)) for p in plan.pieces} == {0, 1}


@pytest.mark.parametrize("tp_t,tp_g", list(itertools.product((1, 2, 4), (1, 2, 4))))
def test_plan_spreads_sending_over_dp_replicas(tp_t, tp_g):
    trainer = TrainerLayout(ranks=tuple(range(2 * tp_t)), tp=tp_t)
    gen = GeneratorLayout(ranks=tuple(range(100, 100 + tp_g)), tp=tp_g)  # one replica: the dp copies share it
    plan = build_plan(specs=SPECS, trainer=trainer, generator=gen, bucket_bytes=4096)
    sent = bytes_sent(plan)
    biggest = max(p.nbytes for p in plan.pieces)
    for t in range(tp_t):
        loads = [sent.get(trainer.rank(d, t), 0) for d in range(trainer.dp)]
        assert min(loads) > 0 and max(loads) - min(loads) <= biggest, loads


def test_plan_relay_off_feeds_every_replica_from_the_trainer():
    trainer = TrainerLayout(ranks=(0, 1), tp=2)
    gen = GeneratorLayout(ranks=(2, 3, 4), tp=1)
    relayed = build_plan(specs=SPECS, trainer=trainer, generator=gen)
    direct = build_plan(specs=SPECS, trainer=trainer, generator=gen, relay=False)
    assert {s.sender for s in relayed.streams} == {0, 1, 2, 3}  # chain 2 -> 3 -> 4
    assert {s.sender for s in direct.streams} == {0, 1}
    for plan in (relayed, direct):
        for rank, (shards, counts) in simulate(plan, arange_weights(SPECS)).items():
            assert all(torch.equal(c, torch.ones_like(c)) for c in counts.values())


def test_plan_is_deterministic_and_checks_its_inputs():
    trainer, gen = TrainerLayout(ranks=(0, 1, 2, 3), tp=2, fsdp=True), GeneratorLayout(ranks=(4, 5), tp=2)
    assert build_plan(specs=SPECS, trainer=trainer, generator=gen) == build_plan(specs=SPECS, trainer=trainer,
                                                                                 generator=gen)
    # overlapping ranks (placement=colocated): a piece the destination rank holds is taken there
    shared = build_plan(specs=SPECS, trainer=trainer, generator=GeneratorLayout(ranks=(3, 4)))
    assert 3 in {p.src for p in shared.pieces if p.dst == 3}  # its own FSDP x tp shard, the rest from the others
    with pytest.raises(ValueError, match="tp=2 must divide its 3 ranks"):
        TrainerLayout(ranks=(0, 1, 2), tp=2)
    assert [chunk(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [chunk(1, 2, i) for i in range(2)] == [(0, 1), (1, 1)]  # torch.chunk leaves the last empty


# ---- names -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_names_stack_tp_local_blocks_like_vllm(tp):
    full = arange_weights(SPECS)
    slots = FUSED.slots(SPECS, tp=tp)
    pre = "model.layers.1"
    assert slots[f"{pre}.self_attn.k_proj.weight"].name == f"{pre}.self_attn.qkv_proj.weight"
    assert slots[f"{pre}.mlp.up_proj.weight"].name == f"{pre}.mlp.gate_up_proj.weight"
    assert slots["model.norm.weight"].name == "model.norm.weight"
    for t in range(tp):
        shapes = FUSED.engine_shapes(SPECS, tp=tp, rank=t)
        engine = {n: torch.full(s, float("nan"), dtype=torch.float64) for n, s in shapes.items()}
        views = targets(FUSED, engine, SPECS, tp=tp, rank=t)
        for n, spec in SPECS.items():  # place each tp-local shard where its slot says
            box = [(0, x) for x in spec.shape]
            if spec.tp_dim is not None:
                box[spec.tp_dim] = chunk(spec.shape[spec.tp_dim], tp, t)
            views[n].copy_(full[n][_sl(box)])
        # what a vLLM rank holds: its q, k, v (gate, up) row blocks, stacked
        rows = lambda n: full[n].chunk(tp, dim=0)[t]  # noqa: E731
        qkv = torch.cat([rows(f"{pre}.self_attn.{x}_proj.weight") for x in "qkv"])
        gate_up = torch.cat([rows(f"{pre}.mlp.{x}_proj.weight") for x in ("gate", "up")])
        assert torch.equal(engine[f"{pre}.self_attn.qkv_proj.weight"], qkv)
        assert torch.equal(engine[f"{pre}.mlp.gate_up_proj.weight"], gate_up)
        assert shapes[f"{pre}.self_attn.qkv_proj.weight"] == ((8 + 4 + 4) * 8 // tp, 38)
        assert not any(torch.isnan(x).any() for x in engine.values())
    assert IDENTITY.slots(SPECS, tp=2)["model.norm.weight"].row_offset == 0


def test_fused_names_reject_a_row_split_they_cannot_stack():
    specs = dict(SPECS)
    name = "model.layers.0.self_attn.k_proj.weight"
    specs[name] = ParamSpec(shape=(30, 38), dtype=torch.float32, tp_dim=0)
    with pytest.raises(ValueError, match="k_proj.weight.*cannot be stacked at tp=4"):
        FUSED.slots(specs, tp=4)


# ---- real pushes between real models on gloo ranks -----------------------------------------------
# (trainer ranks, trainer tp, fsdp, generator ranks, generator tp, names, generator dtype, zero-copy min bytes)
LAYOUTS = {
    "t-tp2 > g-tp1": ((0, 1), 2, False, (2,), 1, "identity", None, 1024),
    "t-fsdp2 > g-tp2": ((0, 1), 1, True, (2, 3), 2, "identity", None, 1024),
    "t-tp2 > g-tp2 fused": ((0, 1), 2, False, (2, 3), 2, "fused", None, 1024),
    "t-tp2 > g-tp1 x3 relayed": ((0, 1), 2, False, (2, 3, 4), 1, "identity", None, None),
    "t-fsdp2xtp2 > g-tp1": ((0, 1, 2, 3), 2, True, (4,), 1, "identity", None, 1024),
    "t-dp2 > g-tp1 x3": ((0, 1), 1, False, (2, 3, 4), 1, "identity", None, None),
    "t-tp1 > g-tp2 x2 relayed": ((0,), 1, False, (1, 2, 3, 4), 2, "identity", None, 1024),
    "t-fsdp2 > g-tp1 bf16": ((0, 1), 1, True, (2,), 1, "identity", torch.bfloat16, 1024),
}


def _train_step(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 96, (2, 6), generator=g)
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    model.zero_grad(set_to_none=True)


def _push_layout(name: str, rank: int):
    t_ranks, tp_t, fsdp, g_ranks, tp_g, names, dtype, zero_copy = LAYOUTS[name]
    # world-synchronised meshes: every rank builds every mesh, in the same order
    t_mesh = build_mesh(ranks=t_ranks, tp=tp_t, members_only=False)
    g_mesh = build_mesh(ranks=g_ranks, tp=tp_g, members_only=False) if tp_g > 1 else None
    specs = param_specs(qwen3(meta=True))
    plan = build_plan(specs=specs, trainer=TrainerLayout(ranks=t_ranks, tp=tp_t, fsdp=fsdp),
                      generator=GeneratorLayout(ranks=g_ranks, tp=tp_g, dtype=dtype), bucket_bytes=8192,
                      zero_copy_min_bytes=zero_copy)
    assert any(map(zero_copy_piece, plan.pieces)) == (zero_copy is not None and dtype is None)
    out = None
    if rank in t_ranks:
        model = parallelize(qwen3(seed=0), mesh=t_mesh, tp=tp_t > 1, fsdp=fsdp)
        push = WeightPush(plan, rank=rank)
        for step in range(2):  # two pushes: the buffers of the first are reused by the second
            _train_step(model, seed=step)
            push.run({n: local(p.detach()) for n, p in model.named_parameters()})
            buffers = push.buffer_bytes if step == 0 else buffers
        assert push.buffer_bytes == buffers
        full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
        out = ("trainer", {n: t.detach().clone() for n, t in full.items()}, push.buffer_bytes, push.streams)
    elif rank in g_ranks:
        t = g_ranks.index(rank) % tp_g
        if names == "fused":  # an engine's own storage, stacked like vLLM's
            tensors = {n: torch.zeros(s) for n, s in FUSED.engine_shapes(specs, tp=tp_g, rank=t).items()}
        elif dtype is not None:
            tensors = {n: torch.zeros(s.shape, dtype=dtype) for n, s in specs.items()}
        else:  # the native engine: the same HF model class, tensor parallel over the generator ranks
            model = qwen3(seed=1)
            if tp_g > 1:
                parallelize(model, mesh=g_mesh, tp=True, fsdp=False)
            tensors = {n: local(p.detach()) for n, p in model.named_parameters()}
        push = WeightPush(plan, rank=rank)
        for _ in range(2):  # into the engine's tensors, through views of them
            push.run(targets(FUSED if names == "fused" else IDENTITY, tensors, specs, tp=tp_g, rank=t))
        out = ("generator", t, {n: x.clone() for n, x in tensors.items()}, push.buffer_bytes, push.streams)
    dist.barrier()
    return out


def _push_main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {name: _push_layout(name, rank) for name in LAYOUTS}
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def pushed():
    return spawn(_push_main, 5, timeout_s=240)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_push_gives_every_generator_shard_bit_for_bit(pushed, layout):
    t_ranks, tp_t, fsdp, g_ranks, tp_g, names, dtype, _ = LAYOUTS[layout]
    _, full, *_ = pushed[t_ranks[0]][layout]
    fresh = qwen3(seed=0)
    assert any(not torch.equal(full[n], p) for n, p in fresh.named_parameters())  # trained, not the init
    specs = param_specs(fresh)
    layout_g = GeneratorLayout(ranks=g_ranks, tp=tp_g)
    for rank in g_ranks:
        _, t, tensors, buffer_bytes, streams = pushed[rank][layout]
        want = {n: full[n][_sl(layout_g.box(s, t=t))] for n, s in specs.items()}
        got = targets(FUSED if names == "fused" else IDENTITY, tensors, specs, tp=tp_g, rank=t)
        for n in specs:
            assert torch.equal(got[n], want[n].to(dtype or want[n].dtype)), (layout, rank, n)
        assert buffer_bytes <= 2 * (8192 + 16) * streams  # two bucket buffers per stream, nothing more
    for rank in t_ranks:
        _, _, buffer_bytes, streams = pushed[rank][layout]
        assert buffer_bytes <= 2 * (8192 + 16) * streams
