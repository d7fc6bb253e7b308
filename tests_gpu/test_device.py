"""Process groups, the resharding push and shared-prompt attention on the device."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from tidal.channels import p2p
from tidal.channels.push import WeightPush
from tidal.channels.push_plan import GeneratorLayout, TrainerLayout, build_plan
from tidal.common.spawn import spawn
from tests_gpu.conftest import needs_devices


def _model(seed: int, device):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(device)


def _plan(model, t_ranks, g_ranks, *, g_tp: int = 1, zero_copy_min_bytes: int = 1 << 16):
    from tidal.modeling.parallel import param_specs

    return build_plan(specs=param_specs(model), trainer=TrainerLayout(ranks=t_ranks, tp=1, fsdp=False),
                      generator=GeneratorLayout(ranks=g_ranks, tp=g_tp), bucket_bytes=1 << 16,
                      zero_copy_min_bytes=zero_copy_min_bytes)


def _start(device_type: str, index: int):
    """This rank's device and process group (the device backend: nccl / hccl; gloo on the CPU
    stand-in), a "trained" model and an engine's copy that differs from it."""
    device = torch.device(device_type, index) if device_type != "cpu" else torch.device("cpu")
    if device_type != "cpu":
        getattr(torch, device_type).set_device(device)
    dist.init_process_group({"cuda": "nccl", "npu": "hccl"}.get(device_type, "gloo"))
    trained, engine = _model(0, device), _model(1, device)
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(1.5)
    return device, trained, engine


def _push_two(device_type: str):
    """Rank 0 trains, rank 1 generates: the push over the device backend (nccl / hccl; gloo on the
    CPU stand-in), every piece from the trainer's device tensors to the generator's."""
    rank = int(__import__("os").environ["RANK"])
    device, trained, engine = _start(device_type, rank)
    plan = _plan(trained, (0,), (1,))
    push = WeightPush(plan, rank=rank, device=device)
    push.run({n: p.detach() for n, p in (trained if rank == 0 else engine).named_parameters()})
    out = {n: p.detach().cpu() for n, p in (trained if rank == 0 else engine).named_parameters()}
    dist.barrier()
    dist.destroy_process_group()
    return out


@needs_devices(2)
def test_push_between_two_devices_over_the_device_backend(device):
    trainer, generator = spawn(_push_two, 2, device.type, timeout_s=300)
    assert trainer.keys() == generator.keys()
    assert all(torch.equal(trainer[n], generator[n]) for n in trainer)


def _push_colocated(device_type: str):
    """One rank is both (placement=colocated, sync): whole tensors are handed over (the generator's
    entries become the trainer's device memory), the small ones copied on the device."""
    device, trained, engine = _start(device_type, 0)
    plan = _plan(trained, (0,), (0,), zero_copy_min_bytes=8192)  # the tiny model's matrices: handed over
    assert all(p.src == p.dst == 0 for p in plan.pieces)
    sender = WeightPush(plan, rank=0, device=device, side="send")
    receiver = WeightPush(plan, rank=0, device=device, side="receive")
    sent = {n: p.detach() for n, p in trained.named_parameters()}
    messages = sender.pack(sent, copy=False)
    assert all(buf.device == device for _, buf in messages)
    works = [p2p.isend(buf, dst, owned=True) for dst, buf in messages]
    shards = {n: p.detach() for n, p in engine.named_parameters()}
    receiver.run(shards)
    for w in works:
        w.wait()
    same = all(torch.equal(sent[n], shards[n]) and shards[n].device == device for n in sent)
    handed = sum(shards[n].data_ptr() == sent[n].data_ptr() for n in sent)
    dist.destroy_process_group()
    return same and handed > 0


def test_colocated_push_hands_over_the_trainer_tensors_on_the_device(device):
    assert spawn(_push_colocated, 1, device.type, timeout_s=300) == [True]


@pytest.mark.parametrize("shared", [True, False])
def test_flex_shared_prompt_mask_equals_dense(device, shared):
    """flex attention's BlockMask (CUDA: forward and backward) against the dense [L, L] mask."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from tidal.modeling.packing import pack_group

    model = _model(0, device)
    model.config._attn_implementation = "sdpa"
    from tidal.modeling.packed_attention import install

    install(model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (9,), generator=g)
    responses = [torch.randint(0, 128, (n,), generator=g) for n in (5, 1, 12, 3)]
    got = {}
    for backend in ("dense", "flex"):
        model.zero_grad(set_to_none=True)
        mbs = pack_group(prompt, responses, token_budget=10 ** 6, pad_id=0, device=device, shared_prompt=shared,
                         backend=backend)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex on the CPU stand-in runs uncompiled, forward only
            if device.type == "cpu":
                with torch.no_grad():
                    logp = [mb.logprobs(model, temperature=1.0) for mb in mbs]
                got[backend] = (logp, None)
                continue
            logp = [mb.logprobs(model, temperature=1.0) for mb in mbs]
            sum(x.sum() for x in logp).backward()
        got[backend] = (logp, [p.grad.clone() for p in model.parameters()])
    for a, b in zip(got["dense"][0], got["flex"][0]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    if got["flex"][1] is not None:
        for a, b in zip(got["dense"][1], got["flex"][1]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_exact_numerics_on_the_device(device, dtype):
    """model.numerics=exact on the device: the engine's log-probs against the trainer's packed forward, and
    a prompt alone against in a batch. On CUDA, cuBLAS picks kernels by shape; exact mode gives every call one
    shape (tidal/modeling/numerics.py), which pins them by the same argument as the CPU's; this is where a device checks
    it (not run on a GPU before)."""
    from tidal.executors.generator.contract import PromptRequest, SamplingParams
    from tidal.executors.generator.native_engine import NativeEngine
    from tidal.modeling.packing import make_micro_batches

    model = _model(0, device).to(dtype)
    engine = NativeEngine(model, eos_token_id=0, pad_token_id=0, max_batch_prompts=4, numerics="exact")
    g = torch.Generator().manual_seed(0)
    reqs = [PromptRequest(index=i, prompt_ids=torch.randint(1, 128, (n,), generator=g).tolist())
            for i, n in enumerate((5, 17, 9, 30, 3, 12))]
    params = SamplingParams(n=4, max_new_tokens=24, seed=1, temperature=1.0)
    groups = {grp.index: grp for grp in engine.generate(reqs, params, step=0)}
    alone = next(iter(engine.generate(reqs[3:4], params, step=0)))
    assert all(torch.equal(a, b) for a, b in zip(alone.logprobs, groups[3].logprobs))
    with torch.no_grad():
        for grp in groups.values():
            for mb in make_micro_batches(grp.prompt_ids_P, grp.response_ids, mode="on", token_budget=4096,
                                         micro_batch_size=8, pad_id=0, device=device):
                logp_NT = mb.logprobs(model, temperature=1.0)
                for n, i in enumerate(mb.samples):
                    assert torch.equal(logp_NT[n, :len(grp.logprobs[i])].cpu(), grp.logprobs[i].cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graph_replay_is_the_eager_step(device, dtype, monkeypatch):
    """The native engine's decode in buckets (tidal/executors/generator/graphs.py): each bucket's captured CUDA graph
    against the same bucketed step run eagerly: the same tokens and log-probs bit for bit (a replay launches the
    eager step's kernels on the same addresses). On the CPU stand-in both decode eagerly."""
    from tidal.executors.generator import graphs as graphs_module
    from tidal.executors.generator.contract import PromptRequest, SamplingParams
    from tidal.executors.generator.native_engine import NativeEngine

    model = _model(0, device).to(dtype)
    g = torch.Generator().manual_seed(0)
    reqs = [PromptRequest(index=i, prompt_ids=torch.randint(1, 128, (n,), generator=g).tolist())
            for i, n in enumerate((5, 17, 9, 30, 3, 12, 7))]
    params = SamplingParams(n=3, max_new_tokens=24, seed=1, temperature=1.0)

    def run():
        engine = NativeEngine(model, eos_token_id=0, pad_token_id=0, max_batch_prompts=3, admission="continuous",
                              graphs=True)
        return {grp.index: grp for grp in engine.generate(reqs, params, step=0)}

    replayed = run()
    init = graphs_module.DecodeGraphs.__init__
    monkeypatch.setattr(graphs_module.DecodeGraphs, "__init__",
                        lambda self, slots, *, capture: init(self, slots, capture=False))
    eager = run()
    assert replayed.keys() == eager.keys()
    for i in eager:
        assert all(torch.equal(a, b) for a, b in zip(eager[i].response_ids, replayed[i].response_ids))
        assert all(torch.equal(a, b) for a, b in zip(eager[i].logprobs, replayed[i].logprobs))
