"""Mixture-of-experts models: the tiny Qwen3-MoE through the engine and the trainer, routing replay,
and expert parallel (trainer.ep) against the single-rank layout."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from tidal.channels.push_plan import GeneratorLayout, TrainerLayout, build_plan
from tidal.modeling import moe
from tidal.modeling.tiny.moe import write_embedded_moe
from tidal.executors.generator.contract import PromptRequest, SamplingParams
from tidal.executors.generator.native_engine import NativeEngine
from tidal.modeling.hf import load_model, load_tokenizer
from tidal.modeling.parallel.tp import param_specs
from tidal.modeling.batching import Routes
from tidal.modeling.packing import make_micro_batches
from tidal.launch.cli import parser, resolve
from tidal.launch.memory import Shape, trainer_parts
from tidal.recipes.grpo import build
from tests.e2e import launch, max_abs_diff, metrics, weights

torch.set_num_threads(1)
CPU = torch.device("cpu")
SAME_THREADS = {"TIDAL_THREADS": "1"}  # a CPU kernel's float sums follow its thread count


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_embedded_moe(tmp_path_factory.mktemp("moe") / "tiny", seed=0)


def _generate(model, tok, *, G: int = 4, max_new_tokens: int = 24):
    engine = NativeEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_batch_prompts=2,
                          admission="continuous")
    prompts = ["jo counts 6 rocks . how many ?", "8 boats for fay .", "a b c"]
    requests = [PromptRequest(index=i, prompt_ids=tok(p)["input_ids"]) for i, p in enumerate(prompts)]
    return list(engine.generate(requests, SamplingParams(n=G, max_new_tokens=max_new_tokens, seed=0), step=0))


def _gaps(model, groups, *, mode: str, shared_prompt: str = "on") -> tuple[torch.Tensor, float]:
    """|trainer - generator| log-prob of every sampled token, and the routing mismatch fraction, with
    the trainer's routers in `mode` (replay or compare)."""
    routing = moe.install(model)
    routing.mode = mode
    gaps, seen, differ = [], 0, 0
    for group in groups:
        routes = Routes(*moe.unpack(group.routing, routing.shape))
        for mb in make_micro_batches(group.prompt_ids_P, group.response_ids, mode=shared_prompt, token_budget=4096,
                                     micro_batch_size=3, pad_id=0, device=CPU, routes=routes):
            with torch.no_grad():
                logp_NT = mb.forward(model, temperature=1.0).logp_NT
            a, b = routing.take()
            seen, differ = seen + a, differ + b
            gaps += [(logp_NT[n, :group.logprobs[i].numel()] - group.logprobs[i]).abs() for n, i in enumerate(mb.samples)]
    return torch.cat(gaps), differ / seen


# ---- the model through the engine and the trainer's micro-batches ------------------------------------
def test_the_engine_records_the_experts_of_every_token_it_fed(tiny):
    model, tok = load_model(str(tiny)), load_tokenizer(str(tiny))
    shape = moe.moe_shape(model.config)
    assert shape == moe.MoeShape(experts=8, top_k=2, layers=(0, 1, 2, 3))
    groups = _generate(model, tok)
    routing = moe.routing_of(model)
    for group in groups:
        prompt, responses = moe.unpack(group.routing, shape)
        assert group.routing[0].dtype == torch.uint8 and prompt.shape == (group.prompt_ids_P.numel(), 4, 2)
        for response, ids in zip(group.response_ids, responses):
            routing.recorded = []
            with torch.no_grad():  # the whole sequence in one forward: the experts of each of its tokens
                model(input_ids=torch.cat([group.prompt_ids_P, response])[None])
            whole = torch.stack(routing.recorded, dim=1)
            got = torch.cat([prompt, ids])
            # every token but the last (never fed: it predicts nothing) has its experts, as a set
            assert (got[-1] == moe.UNRECORDED).all() and (got[:-1] != moe.UNRECORDED).all()
            assert torch.equal(got[:-1].sort(-1).values, whole[:-1].sort(-1).values)
    routing.recorded = []


@pytest.mark.parametrize("shared_prompt", ["padded", "on", "off"])
def test_trainer_logprobs_equal_the_hf_forward(tiny, shared_prompt):
    """Packed (shared prompt, varlen) and padded micro-batches of the MoE give the HF model's own
    log-probs of [prompt, response], and with routing replay the generator's within float noise."""
    model, tok = load_model(str(tiny)), load_tokenizer(str(tiny))
    groups = _generate(copy.deepcopy(model), tok)
    for group in groups[:2]:
        for mb in make_micro_batches(group.prompt_ids_P, group.response_ids, mode=shared_prompt, token_budget=60,
                                     micro_batch_size=3, pad_id=0, device=CPU):
            with torch.no_grad():
                logp_NT = mb.forward(model, temperature=1.0).logp_NT
            for n, i in enumerate(mb.samples):
                ids = torch.cat([group.prompt_ids_P, group.response_ids[i]])[None]
                P, R = group.prompt_ids_P.numel(), group.response_ids[i].numel()
                with torch.no_grad():
                    logits = model(input_ids=ids).logits[0, P - 1:P + R - 1].float()
                ref = torch.log_softmax(logits, -1).gather(-1, group.response_ids[i][:, None])[:, 0]
                assert torch.allclose(logp_NT[n, :R], ref, atol=1e-5, rtol=0)
    gaps, differ = _gaps(model, groups, mode="replay", shared_prompt=shared_prompt)
    assert gaps.max() < 1e-5 and differ == 0.0


def test_replay_removes_the_gap_of_a_router_that_chose_otherwise(tiny):
    """The generator's routers perturbed (as another kernel would round near-ties): some tokens went
    through other experts. The trainer's own routing is then far from the generator's log-probs;
    replaying the generator's choice leaves only the mixing weights' small difference."""
    model, tok = load_model(str(tiny)), load_tokenizer(str(tiny))
    generator = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in generator.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(0.01 * p.abs().mean() * torch.randn(p.shape, generator=g))
    groups = _generate(generator, tok)
    own, own_differ = _gaps(copy.deepcopy(model), groups, mode="compare")
    replayed, replay_differ = _gaps(copy.deepcopy(model), groups, mode="replay")
    assert own_differ > 0.01 and replay_differ > 0.01  # measured: 0.038 and 0.032 of the tokens
    assert own.max() > 1e-3  # measured: 0.021
    assert replayed.max() < own.max() / 50  # measured: 1.0e-4, 200x smaller


def test_routing_travels_compactly():
    """uint8 ids (255 marks an unrecorded token) below 255 experts, int16 from there."""
    small, big = moe.MoeShape(8, 2, (0, 1)), moe.MoeShape(300, 2, (0, 1))
    for shape in (small, big):
        prompt = torch.randint(0, shape.experts, (5, 2, 2))
        responses = [torch.randint(0, shape.experts, (3, 2, 2)), torch.full((1, 2, 2), moe.UNRECORDED)]
        flat = moe.pack(prompt, responses, shape)
        assert {t.dtype for t in flat} == {shape.id_dtype} and flat[0].numel() == 20
        p, rs = moe.unpack(flat, shape)
        assert torch.equal(p, prompt) and all(torch.equal(a, b) for a, b in zip(rs, responses))
    assert small.id_dtype == torch.uint8 and big.id_dtype == torch.int16


def test_the_push_takes_each_expert_from_a_rank_that_holds_it(tiny):
    model = load_model(str(tiny))
    specs = param_specs(model)
    assert specs["model.layers.0.mlp.experts.gate_up_proj"].ep_dim == 0
    assert specs["model.layers.0.mlp.gate.weight"].ep_dim is None
    trainer = TrainerLayout(ranks=(2, 3, 4, 5), ep=2)  # dp 4: ranks 2, 4 hold experts 0-3; 3, 5 hold 4-7
    plan = build_plan(specs=specs, trainer=trainer, generator=GeneratorLayout(ranks=(0,)), bucket_bytes=1 << 20)
    covered = {}
    for piece in plan.pieces:
        if specs[piece.name].ep_dim is None:
            continue
        (lo, hi), *_ = piece.dst_slice
        owners = (2, 4) if hi <= 4 else (3, 5)
        assert lo // 4 == (hi - 1) // 4 and piece.src in owners, piece
        covered[piece.name] = covered.get(piece.name, 0) + piece.numel
    assert covered == {name: s.shape[0] * s.shape[1] * s.shape[2] for name, s in specs.items() if s.ep_dim == 0}


def test_the_memory_estimate_counts_every_expert_and_the_active_ones(tiny):
    model = load_model(str(tiny))
    shape = Shape.of(str(tiny))
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.expert_params == sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = shape.params - shape.expert_params * (1 - 2 / 8)  # 2 of 8 experts a token
    assert shape.active_params == active
    one = trainer_parts(resolve(parser().parse_args(["--algo", "grpo", "--set", f"model.path={tiny}",
                                                     "--set", "trainer.dp=2"])), shape)
    two = trainer_parts(resolve(parser().parse_args(["--algo", "grpo", "--set", f"model.path={tiny}",
                                                     "--set", "trainer.dp=2", "--set", "trainer.ep=2"])), shape)
    assert one["weights"] - two["weights"] == pytest.approx(shape.expert_params * 4 / 2)


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (("trainer.dp=3", "trainer.ep=3"), "trainer.ep=3 must divide the model's 8 experts"),
    (("trainer.dp=3", "trainer.ep=2"), "trainer.ep=2 must divide trainer.dp=3"),
    (("trainer.dp=2", "trainer.ep=2", "trainer.fsdp=true"), "expert parallel runs with tp=1 and without fsdp"),
    (("trainer.routing_replay=true", "rollout=multi_turn"), "built for single-turn rollouts generated whole"),
    (("trainer.routing_replay=true", "generator.partial_rollout_tokens=8"), "built for single-turn rollouts"),
    (("trainer.tp=2",), "no tensor-parallel plan for model_type='qwen3_moe'"),
    (("generator.engine=vllm",), "weight pushes into vLLM's fused-MoE layers are not verified"),
])
def test_bad_moe_settings_are_refused_before_any_rank_starts(tiny, args, message):
    sets = [x for a in (f"model.path={tiny}", *args) for x in ("--set", a)]
    with pytest.raises(ValueError) as err:
        build(resolve(parser().parse_args(["--algo", "grpo", *sets])))
    assert message in str(err.value)


@pytest.mark.parametrize("args, message", [
    (("trainer.dp=2", "trainer.ep=2"), "trainer.ep=2: the model (model_type 'qwen3') is dense"),
    (("trainer.routing_replay=true",), "trainer.routing_replay=true: the model (model_type 'qwen3') is dense"),
])
def test_moe_settings_on_a_dense_model_are_refused(args, message):
    with pytest.raises(ValueError) as err:
        build(resolve(parser().parse_args(["--algo", "grpo", *[x for a in args for x in ("--set", a)]])))
    assert message in str(err.value)


def test_a_config_asking_for_the_auxiliary_loss_is_refused(tiny, tmp_path):
    import shutil

    shutil.copytree(tiny, tmp_path / "aux")
    config = json.loads((tmp_path / "aux" / "config.json").read_text())
    (tmp_path / "aux" / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    with pytest.raises(ValueError, match="asks for the load-balancing auxiliary loss"):
        build(resolve(parser().parse_args(["--algo", "grpo", "--set", f"model.path={tmp_path / 'aux'}"])))


def test_the_critic_has_no_expert_parallel():
    with pytest.raises(ValueError, match="critic.ep=2: expert parallel is built for the trainer's policy only"):
        build(resolve(parser().parse_args(["--algo", "ppo", "--set", "critic.ep=2", "--set", "critic.dp=2"])))


# ---- whole jobs: expert parallel against one set of experts -----------------------------------------
TWO = ("--schedule", "sync", "--set", "trainer.dp=2", "--set", "generator.max_new_tokens=16")
RUNS = {  # name: extra args (4 ranks: generator, reward, trainer dp 2)
    "ep1": (),
    "ep2": ("--set", "trainer.ep=2", "--set", "checkpoint_every=1", "--set", "checkpoint_keep=0"),
    "ep2 periodic": ("--set", "trainer.ep=2", "--schedule", "periodic"),
    "ep2 replay": ("--set", "trainer.ep=2", "--set", "trainer.routing_replay=true"),
    "ep2 lora": ("--set", "trainer.ep=2", "--set", "trainer.lora.rank=8", "--set", "trainer.lr=1e-2"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny):
    root = tmp_path_factory.mktemp("moe_runs")
    for name, args in RUNS.items():
        proc = launch(root / name, "--set", f"model.path={tiny}", *TWO, *args, nproc=4, steps=4, timeout=600,
                      env=SAME_THREADS)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    return root


def test_expert_parallel_equals_one_set_of_experts(runs, tiny):
    """ep=2 (each trainer rank 4 of the 8 experts, tokens exchanged by all-to-all) against ep=1: the
    same samples every step (the pushes put the experts back together) and the same final weights
    within float noise (another order of the experts' sums)."""
    a, b = metrics(runs / "ep1"), metrics(runs / "ep2")
    assert [r["trainer/rollout_digest"] for r in a] == [r["trainer/rollout_digest"] for r in b]
    assert len({r["trainer/rollout_digest"] for r in a}) == 4
    wa, wb = weights(runs / "ep1" / "final"), weights(runs / "ep2" / "final")
    assert wb["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 128, 128)  # every expert, in the HF layout
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
    initial = weights(tiny)
    assert all(not torch.equal(initial[k], wb[k]) for k in wb if ".experts." in k)  # every expert trained


def test_expert_parallel_streams_like_the_sync_schedule(runs):
    """periodic hands groups over as they finish; the lockstep rounds keep the bits of sync."""
    a, b = metrics(runs / "ep2"), metrics(runs / "ep2 periodic")
    assert [r["trainer/rollout_digest"] for r in a] == [r["trainer/rollout_digest"] for r in b]
    wa, wb = weights(runs / "ep2" / "final"), weights(runs / "ep2 periodic" / "final")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_every_step_reports_the_routing_mismatch(runs):
    """The native engine and the trainer route alike here: 0, and replaying that routing changes no bit."""
    for name in RUNS:
        assert [r["trainer/routing_mismatch_frac"] for r in metrics(runs / name)] == [0.0] * 4, name
    a, b = metrics(runs / "ep2"), metrics(runs / "ep2 replay")
    assert [r["trainer/rollout_digest"] for r in a] == [r["trainer/rollout_digest"] for r in b]
    wa, wb = weights(runs / "ep2" / "final"), weights(runs / "ep2 replay" / "final")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_lora_on_an_moe_model_with_expert_parallel(runs):
    """The adapters (attention only: the experts are no Linear modules) train on the frozen, split experts;
    the pushes carry the adapters alone and the engine samples with them."""
    from safetensors.torch import load_file

    rows = metrics(runs / "ep2 lora")
    adapter = load_file(runs / "ep2 lora" / "final" / "adapter_model.safetensors")
    assert all(".self_attn." in k for k in adapter) and not (runs / "ep2 lora" / "final" / "model.safetensors").exists()
    assert {r["trainer/push_bytes"] for r in rows} == {sum(t.numel() * 4 for t in adapter.values())}
    assert all(r["trainer/logp_mismatch_max"] < 1e-5 for r in rows) and len({r["trainer/rollout_digest"] for r in rows}) == 4


def test_expert_parallel_resumes_bit_for_bit(runs, tmp_path, tiny):
    ckpt = runs / "ep2" / "checkpoints" / "step_000001"
    proc = launch(tmp_path, "--set", f"model.path={tiny}", *TWO, "--set", "trainer.ep=2", "--resume", str(ckpt), nproc=4,
                  steps=4, timeout=600, env=SAME_THREADS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole, resumed = weights(runs / "ep2" / "final"), weights(tmp_path / "final")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert [r["trainer/rollout_digest"] for r in metrics(tmp_path)][-2:] == [r["trainer/rollout_digest"] for r in metrics(runs / "ep2")][-2:]


def test_an_expert_parallel_checkpoint_resumes_under_another_ep(runs, tmp_path, tiny):
    """The optimizer state of ep=2's expert shards, resharded by torch.distributed.checkpoint into
    ep=1's whole experts: the run goes on as the ep=2 run did, within float noise."""
    ckpt = runs / "ep2" / "checkpoints" / "step_000001"
    proc = launch(tmp_path, "--set", f"model.path={tiny}", *TWO, "--resume", str(ckpt), nproc=4, steps=4,
                  timeout=600, env=SAME_THREADS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["trainer/rollout_digest"] for r in metrics(tmp_path)][-2:] == [r["trainer/rollout_digest"] for r in metrics(runs / "ep2")][-2:]
    assert max_abs_diff(weights(runs / "ep2" / "final"), weights(tmp_path / "final")) < 1e-5


# ---- the Qwen3-30B-A3B preset ---------------------------------------------------------------------
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B's published config.json (the fields the checks and estimates read)
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}


def test_the_qwen3_30b_a3b_preset_places_and_fits(tmp_path):
    """On the published config's shape: 16 co-located ranks, 30.5B parameters of which 3.3B active, each
    trainer rank 8 of the 128 experts, and every rank within an H200's 141 GB."""
    from tidal.controller.world import placement, world_size_of
    from tidal.launch.dryrun import describe
    from tidal.launch.memory import describe_memory
    from tidal.recipes.registry import recipe_for
    from tests.e2e import ROOT

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    cfg = resolve(parser().parse_args(["--algo", "grpo", "--config", str(ROOT / "configs" / "qwen3-30b-a3b-16xh200.yaml"),
                                       "--set", f"model.path={tmp_path}"]))
    recipe = recipe_for(cfg.algo)
    graph = recipe.build(cfg)  # the expert-parallel and routing checks against the model's experts
    assert world_size_of(graph) == 16 and placement(graph)["trainer"] == placement(graph)["generator"]
    shape = Shape.of(str(tmp_path))
    assert abs(shape.params - 30.5e9) / 30.5e9 < 0.01 and abs(shape.active_params - 3.3e9) / 3.3e9 < 0.03
    table = describe_memory(cfg, shape, device="cuda")
    rank = next(line for line in table.splitlines() if line.startswith("co-located rank"))
    assert float(rank.split()[-2]) < 0.95 * 141, rank  # GB; the KV cache and AdamW's state take turns
    assert "30.53B (3.35B active per token)" in describe(graph, cfg, recipe, memory=table)
