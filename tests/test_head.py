"""The LM head in chunks (tidal/modeling/head.py) against the whole-vocabulary reference.

Chunked log-probs, entropy and the gradients they give equal the whole head's (one [K, V] logits
tensor, as the trainer computed before chunking) within 1e-6 (relative) in fp32, for padded, varlen and
shared-prompt micro-batches; the whole head equals the textbook computation on each sequence alone.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate

from tidal.executors.generator.native_engine import NativeEngine
from tidal.modeling.head import Fp32Head, fp32_logits
from tidal.modeling.packing import make_micro_batches
from tests.test_parallel import tiny

TEMP = 0.7


def _group(lens=(9, 4, 13, 1, 7)):
    g = torch.Generator().manual_seed(3)
    prompt_P = torch.randint(1, 96, (6,), generator=g)
    return prompt_P, [torch.randint(1, 96, (n,), generator=g) for n in lens]


def _reference(model, prompt_P, responses):
    """Per sample: log-probs and entropy of its response tokens from the full logits of [prompt, r]."""
    P, logps, ents = prompt_P.numel(), [], []
    for r in responses:
        logits_LV = model(input_ids=torch.cat([prompt_P, r])[None]).logits[0]
        logp_RV = torch.log_softmax(logits_LV[P - 1: P - 1 + r.numel()].float() / TEMP, dim=-1)
        logps.append(logp_RV.gather(-1, r[:, None])[:, 0])
        ents.append(-(logp_RV.exp() * logp_RV).sum(-1).detach())
    return logps, ents


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _run(model, mbs, responses, *, chunk):
    """Log-probs and entropy per sample, and the gradient of a per-sample weighted log-prob sum."""
    model.zero_grad()
    logps, ents, loss = {}, {}, 0
    for mb in mbs:
        logp_NT, ent_NT = mb.forward(model, temperature=TEMP, chunk=chunk, entropy=True)
        assert logp_NT.dtype == ent_NT.dtype == torch.float32 and not ent_NT.requires_grad
        for n, i in enumerate(mb.samples):
            R = responses[i].numel()
            assert not logp_NT[n, R:].any() and not ent_NT[n, R:].any()  # padding stays 0
            logps[i], ents[i] = logp_NT[n, :R].detach(), ent_NT[n, :R]
            loss = loss + logp_NT[n, :R].sum() * (i + 1)
    loss.backward()
    return logps, ents, _grads(model)


def _max_diff(a: dict, b: dict) -> float:
    """Max difference relative to the magnitude (at least 1): an entropy near log(96) = 4.56 is
    ~4.8e-7 per fp32 ulp, and a one-row head product rounds differently from a many-row one."""
    return max(((a[k] - b[k]).abs() / b[k].abs().clamp(min=1)).max().item() for k in a)


def _grad_diff(a: dict, b: dict) -> float:
    """Max difference of each gradient relative to its largest element: the head's gradient is
    summed chunk by chunk, a different order of fp32 additions."""
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)).item() for k in a)


@pytest.mark.parametrize("mode", ["padded", "off", "on"])
@pytest.mark.parametrize("chunk", [1, 4, 5, 1000])
def test_chunked_head_equals_whole_vocabulary(mode, chunk):
    model, (prompt_P, responses) = tiny("qwen3"), _group()
    mbs = make_micro_batches(prompt_P, responses, mode=mode, token_budget=4096, micro_batch_size=8, pad_id=0,
                             device=torch.device("cpu"))
    whole = _run(model, mbs, responses, chunk=0)
    chunked = _run(model, mbs, responses, chunk=chunk)
    # the same micro-batches: only the head's chunking differs
    assert _max_diff(chunked[0], whole[0]) < 1e-6 and _max_diff(chunked[1], whole[1]) < 1e-6
    assert _grad_diff(chunked[2], whole[2]) < 1e-6
    # and the whole head is the textbook computation on each [prompt, response] alone (a padded or
    # packed row rounds attention differently: a few fp32 ulps of an entropy near log(96) = 4.56)
    ref_logp, ref_ent = _reference(model, prompt_P, responses)
    assert _max_diff(whole[0], dict(enumerate(ref_logp))) < 1e-5
    assert _max_diff(whole[1], dict(enumerate(ref_ent))) < 1e-5
    model.zero_grad()
    sum(l.sum() * (i + 1) for i, l in enumerate(ref_logp)).backward()
    assert _grad_diff(whole[2], _grads(model)) < 1e-5


@pytest.mark.parametrize("mode", ["padded", "on"])
@pytest.mark.parametrize("chunk", [0, 4])
def test_the_entropy_asked_with_its_gradient_gives_the_textbook_gradient(mode, chunk):
    """entropy="grad" (an entropy bonus, algorithm.entropy_coef): the entropy keeps its gradient through the
    chunks' recompute, and d(sum of the entropies weighted per sample) equals the textbook's on each sequence."""
    model, (prompt_P, responses) = tiny("qwen3"), _group()
    mbs = make_micro_batches(prompt_P, responses, mode=mode, token_budget=4096, micro_batch_size=8, pad_id=0,
                             device=torch.device("cpu"))
    model.zero_grad()
    loss = 0
    for mb in mbs:
        _, ent_NT = mb.forward(model, temperature=TEMP, chunk=chunk, entropy="grad")
        assert ent_NT.requires_grad
        loss = loss + sum(ent_NT[n].sum() * (i + 1) for n, i in enumerate(mb.samples))
    loss.backward()
    got = _grads(model)
    model.zero_grad()
    P = prompt_P.numel()
    for i, r in enumerate(responses):
        logits_LV = model(input_ids=torch.cat([prompt_P, r])[None]).logits[0]
        logp_RV = torch.log_softmax(logits_LV[P - 1: P - 1 + r.numel()].float() / TEMP, dim=-1)
        (-(logp_RV.exp() * logp_RV).sum() * (i + 1)).backward()
    assert _grad_diff(got, _grads(model)) < 1e-5


def test_chunks_are_recomputed_not_kept():
    """Under autograd a chunked head keeps no [tokens, vocab] tensor for the backward: the saved
    tensors of the graph hold at most one chunk's worth of vocabulary rows while it is built."""
    model, (prompt_P, responses) = tiny("qwen3"), _group((40, 40))
    V = model.config.vocab_size
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # the head's weight is saved too
    mb = make_micro_batches(prompt_P, responses, mode="off", token_budget=4096, micro_batch_size=8, pad_id=0,
                            device=torch.device("cpu"))[0]

    def saved_vocab_rows(chunk):
        rows = []

        def pack(t):
            if t.dim() >= 2 and t.shape[-1] == V and t.untyped_storage().data_ptr() not in weights:
                rows.append(t.numel() // V)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # what the forward keeps
            logp_NT = mb.forward(model, temperature=TEMP, chunk=chunk).logp_NT
        logp_NT.sum().backward()
        return sum(rows)

    assert saved_vocab_rows(0) >= 80  # the whole head: every response token's logits are kept
    assert saved_vocab_rows(8) == 0  # chunks: recomputed in the backward, only hidden states kept


def test_bf16_head_logits_are_float32_products_of_its_bf16_inputs():
    """A bf16 head's logits are the exact product of its bf16 inputs, in float32 (not rounded to
    bf16, whose rounding alone moved a log-prob by up to 0.06 on a real model); a float32 head runs
    as itself, bit for bit."""
    head = tiny("llama", tie=False).get_output_embeddings()
    h_CH = torch.randn(7, head.in_features, generator=torch.Generator().manual_seed(1))
    assert torch.equal(fp32_logits(head, h_CH), head(h_CH))
    head16, h16_CH = copy.deepcopy(head).bfloat16(), h_CH.bfloat16()
    exact_CV = h16_CH.double() @ head16.weight.double().T
    got_CV = fp32_logits(head16, h16_CH)
    assert got_CV.dtype == torch.float32
    scale = exact_CV.abs().max().item()
    assert (got_CV.double() - exact_CV).abs().max().item() < 1e-6 * scale
    assert (head16(h16_CH).double() - exact_CV).abs().max().item() > 1e-3 * scale  # what bf16 logits lose


def test_fp32_head_hook_follows_pushed_weights():
    """The generator's hook keeps its head's float32 weight, and re-casts it after a push: one that
    lands through a torch op (the version counter moves) and one written into the weight's storage
    unseen (as the WEIGHTS channel's receives are), announced by the engine's load_weights; and a tensor
    handed over in place of the weight (co-located), which the engine's parameter takes as its own."""
    assert Fp32Head.install(tiny("llama", tie=False)) is None  # a float32 model keeps its own head
    model = tiny("llama", tie=False).bfloat16()
    engine = NativeEngine(model, eos_token_id=0, pad_token_id=0)
    ids = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(2))
    weight = model.get_output_embeddings().weight
    shards = {n: p.detach() for n, p in model.named_parameters()}  # what the WEIGHTS channel lands in
    name = next(n for n, p in model.named_parameters() if p is weight)

    def hand_over():  # placement=colocated: the channel puts the trainer's own tensor in the entry's place
        shards[name] = weight.detach() * 5

    for push in (None, lambda: weight.mul_(2), lambda: weight.data.mul_(3), hand_over):
        if push is not None:
            with torch.no_grad():
                push()
            engine.load_weights(shards, None)
        assert model.get_output_embeddings().weight.data_ptr() == shards[name].data_ptr()  # the engine's own
        with torch.inference_mode():  # as the engine runs it
            logits = model(input_ids=ids).logits
            h = model.model(input_ids=ids).last_hidden_state
        assert logits.dtype == torch.float32
        assert torch.equal(logits, F.linear(h.float(), shards[name].float()))


def _tp_head(world: int):
    """On 2 gloo ranks: a bf16 vocabulary-sharded head (ColwiseParallel, as parallel/tp.py lays it)
    gives the unsharded head's float32 logits and the full gradient of its replicated input."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    dist.init_process_group("gloo")  # rank and world from spawn's environment
    try:
        head = tiny("llama", tie=False).get_output_embeddings().bfloat16()
        h_CH = torch.randn(6, head.in_features, generator=torch.Generator().manual_seed(3)).bfloat16()
        w_CV = torch.randn(6, head.out_features, generator=torch.Generator().manual_seed(4))
        ref_h = h_CH.clone().requires_grad_()
        ref = fp32_logits(head, ref_h)
        (ref * w_CV).sum().backward()
        sharded = parallelize_module(copy.deepcopy(head), init_device_mesh("cpu", (world,)),
                                     ColwiseParallel(output_layouts=Replicate()))
        tp_h = h_CH.clone().requires_grad_()
        got = fp32_logits(sharded, tp_h)
        (got * w_CV).sum().backward()
        return torch.equal(got, ref), (tp_h.grad.float() - ref_h.grad.float()).abs().max().item()
    finally:
        dist.destroy_process_group()


def test_bf16_head_logits_under_tensor_parallel():
    from tidal.common.spawn import spawn

    for same, grad_err in spawn(_tp_head, 2, 2, timeout_s=120):
        assert same and grad_err < 1e-2, grad_err  # the input's gradient: bf16, summed over the shards
