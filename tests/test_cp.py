"""Context parallel (tidal/modeling/parallel/cp.py) against the single-rank forward of the same packed row.

Four gloo ranks run every case at cp=1 (each rank alone: `PackedMicroBatch.forward`), cp=2 (two groups of two)
and cp=4: the log-probs, the entropy and the parameter gradients of a loss on both (summed over the cp group, as the step sums
them over the layout's dp) must equal cp=1's to EQUAL / close_grads (tests/tolerances.py: float64 models, the
same sums in another order). Rows: a shared prompt, varlen rows, a multi-turn row's loss masks, a row longer
than a sliding-window layer's window, activation checkpointing (its recompute gathers the keys again). And
the memory a backward keeps (the tensors autograd saves, the parameters aside) falls with cp on a long row.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from tests.tolerances import EQUAL, close_grads
from tidal.common.spawn import spawn
from tidal.modeling.hf import load_model
from tidal.modeling.packing import pack_group
from tidal.modeling.parallel import apply_ac
from tidal.modeling.parallel.cp import context_groups, forward as cp_forward

CPU = torch.device("cpu")


def _gemma(window: int):
    """Gemma-3's layout, a sliding layer then a full one; float64."""
    config = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                              sliding_window=window, layer_types=["sliding_attention", "full_attention"])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).double()


def _row(*, vocab: int, P: int, lens, shared: bool, masks: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (P,), generator=g)
    responses = [torch.randint(3, vocab, (R,), generator=g) for R in lens]
    loss_masks = [torch.rand(R, generator=g) < 0.6 for R in lens] if masks else None
    (mb,) = pack_group(prompt, responses, token_budget=10 ** 6, pad_id=0, device=CPU, shared_prompt=shared,
                       loss_masks=loss_masks)
    return mb


def _run(model, mb, forward):
    """(log-probs, entropy, gradients) of a loss with fixed random token weights on both (the entropy with its
    gradient, as an entropy bonus takes it)."""
    model.zero_grad(set_to_none=True)
    out = forward(model, mb)
    g = torch.Generator().manual_seed(1)
    w_NT, v_NT = (torch.randn(mb.mask_NT.shape, generator=g, dtype=out.logp_NT.dtype) for _ in range(2))
    (out.logp_NT * w_NT + out.entropy_NT * v_NT).sum().backward()
    return out.logp_NT.detach(), out.entropy_NT.detach(), [p.grad.clone() for p in model.parameters()]


def _compare(model, mb, groups) -> dict:
    ref = _run(model, mb, lambda m, b: b.forward(m, temperature=0.7, entropy="grad"))
    out = {}
    for name, cp in groups.items():
        logp, ent, grads = _run(model, mb, lambda m, b: cp_forward(b, m, cp=cp, temperature=0.7, entropy="grad"))
        for g in grads:
            dist.all_reduce(g, group=cp.group)
        out[name] = dict(logp=(logp - ref[0]).abs().max().item(), entropy=(ent - ref[1]).abs().max().item(),
                         grads=close_grads(grads, ref[2]))
    return out


def _saved_bytes(model, mb, forward) -> int:
    """Bytes of the tensors autograd keeps for the backward, the parameters (and views of them) aside."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(model, mb)
    out.logp_NT.sum().backward()
    return sum(seen.values())


def _ranks_main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # every rank makes both layouts' groups, in the same order
    groups = {"cp2": context_groups(ranks=range(4), cp=2, tp=1), "cp4": context_groups(ranks=range(4), cp=4, tp=1)}
    embedded = load_model(None).double()
    vocab = embedded.config.vocab_size
    out = {
        "shared": _compare(embedded, _row(vocab=vocab, P=9, lens=[5, 12, 1, 7], shared=True), groups),
        "varlen": _compare(embedded, _row(vocab=vocab, P=6, lens=[4, 9, 3], shared=False), groups),
        "loss masks": _compare(embedded, _row(vocab=vocab, P=5, lens=[8, 11], shared=False, masks=True), groups),
        # 3 tokens: shorter than the smallest cp=4 split's padding, so a rank holds padding alone
        # 400 tokens: several query tiles a rank (cp.TILE), each over the keys it sees
        "tiles": _compare(embedded, _row(vocab=vocab, P=40, lens=[150, 90, 120], shared=True), groups),
        "tiny row": _compare(embedded, _row(vocab=vocab, P=2, lens=[1], shared=True), groups),
        # a row of 40 tokens through a window of 5: the window by the positions the model sees
        "sliding window": _compare(_gemma(5), _row(vocab=96, P=7, lens=[13, 9, 11], shared=True), groups),
    }
    checkpointed = load_model(None).double()
    apply_ac(checkpointed)
    out["activation checkpointing"] = _compare(checkpointed, _row(vocab=vocab, P=9, lens=[5, 12, 7], shared=True),
                                               groups)
    # a long row in float32: what each rank keeps for the backward
    model = load_model(None)
    long_row = _row(vocab=vocab, P=64, lens=[120] * 8, shared=True)
    out["saved"] = {"cp1": _saved_bytes(model, long_row, lambda m, b: b.forward(m, temperature=1.0))} | {
        name: _saved_bytes(model, long_row, lambda m, b: cp_forward(b, m, cp=cp, temperature=1.0))
        for name, cp in groups.items()}
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_ranks_main, 4, timeout_s=300)


CASES = ["shared", "tiles", "varlen", "loss masks", "tiny row", "sliding window", "activation checkpointing"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cp", ["cp2", "cp4"])
def test_context_parallel_equals_one_rank(results, case, cp):
    for rank, out in enumerate(results):
        got = out[case][cp]
        assert got["logp"] <= EQUAL["atol"] and got["entropy"] <= EQUAL["atol"], (rank, case, cp, got)
        assert got["grads"], (rank, case, cp)


def test_context_parallel_keeps_less_for_the_backward(results):
    saved = results[0]["saved"]
    # activations scale with a rank's 2S tokens; each layer's gathered keys and values (the whole row's) do not
    assert saved["cp2"] < 0.6 * saved["cp1"] and saved["cp4"] < 0.35 * saved["cp1"], saved
