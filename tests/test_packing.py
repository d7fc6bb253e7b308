"""Shared-prompt and varlen packing against the separate padded rows of `batching.split_group`."""
import dataclasses
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
from transformers.masking_utils import AttentionMaskInterface

import tidal.modeling.packed_attention as packed_attention
from tidal.modeling.hf import load_model
from tidal.modeling.parallel.ac import apply_ac
from tidal.modeling.batching import MicroBatch, split_group
from tidal.modeling.packed_attention import ATTN_NAME, PackMask, install
from tests.tolerances import EQUAL, close_grads
from tidal.modeling.packing import (
    PackedMicroBatch,
    auto_shared_prompt,
    make_micro_batches,
    pack_group,
)

torch.set_num_threads(1)
CPU = torch.device("cpu")
TEMP = 0.7
UNBOUNDED = 10 ** 6


def _model(**kw):
    """The embedded model in float64: packed and separate rows are the same math in another order (EQUAL)."""
    return load_model(None, **kw).double()


def _group(*, vocab: int, P: int, lens, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (P,), generator=g), [torch.randint(0, vocab, (R,), generator=g) for R in lens]


def _family(config_cls):
    config = config_cls(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).double()


def _logp_GT(model, mbs, *, G: int, T: int) -> torch.Tensor:
    """Each micro-batch's [N, T'] rows scattered back to group order, [G, T]."""
    out = torch.zeros(G, T, dtype=torch.float64)
    for mb in mbs:
        logp_NT = mb.logprobs(model, temperature=TEMP)
        assert logp_NT.dtype == torch.float64 and logp_NT.shape == mb.mask_NT.shape == mb.targets_NT.shape
        assert torch.all(logp_NT[~mb.mask_NT] == 0)
        out[list(mb.samples), : logp_NT.shape[1]] = logp_NT
    return out


def _reference(model, prompt, responses):
    mbs = split_group(prompt, responses, micro_batch_size=len(responses), pad_id=0, device=CPU)
    return _logp_GT(model, mbs, G=len(responses), T=mbs[0].mask_NT.shape[1])


def _close_grads(got, ref) -> bool:
    """The shared prompt's gradient sums the G responses' contributions in another place (close_grads)."""
    return close_grads(got, ref)


def _grads(model, mbs, *, G: int) -> list[torch.Tensor]:
    """Gradient of sum(logp * w) with weights that differ per sample and per token."""
    model.zero_grad(set_to_none=True)
    for mb in mbs:
        logp_NT = mb.logprobs(model, temperature=TEMP)
        w_NT = torch.linspace(-1.0, 2.0, G)[list(mb.samples), None] + 0.1 * torch.arange(logp_NT.shape[1])
        (logp_NT * w_NT).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


# (P, response lengths, token budget shared / varlen): uneven with an empty response, G=1, length-1
# responses, and budgets that split the group over two rows (shared: 7+5+1 | 7+9+3; varlen: 12+8 | 16+10)
SPLIT = {True: 20, False: 26}
NO_SPLIT = {True: UNBOUNDED, False: UNBOUNDED}
CASES = [(7, (5, 1, 9, 3, 0), NO_SPLIT), (7, (6,), NO_SPLIT), (4, (1, 1, 1), NO_SPLIT), (7, (5, 1, 9, 3), SPLIT)]


@pytest.mark.parametrize("backend", ["blocks", "dense"])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("P,lens,budgets", CASES)
def test_packed_logprobs_equal_separate_rows(P, lens, budgets, shared, backend):
    model = _model(seed=0)
    prompt, responses = _group(vocab=model.config.vocab_size, P=P, lens=lens)
    ref_GT = _reference(model, prompt, responses)
    mbs = pack_group(prompt, responses, token_budget=budgets[shared], pad_id=0, device=CPU, shared_prompt=shared,
                     backend=backend)
    assert [mb.samples for mb in mbs] == ([(0, 1), (2, 3)] if budgets is SPLIT else [tuple(range(len(lens)))])
    assert torch.allclose(_logp_GT(model, mbs, G=len(lens), T=ref_GT.shape[1]), ref_GT, **EQUAL)


@pytest.mark.parametrize("shared", [True, False])
def test_gradients_equal_separate_rows(shared):
    model = _model(seed=0)
    prompt, responses = _group(vocab=model.config.vocab_size, P=7, lens=(5, 1, 9, 3))
    ref = _grads(model, split_group(prompt, responses, micro_batch_size=4, pad_id=0, device=CPU), G=4)
    for budgets in (NO_SPLIT, SPLIT):
        got = _grads(model, pack_group(prompt, responses, token_budget=budgets[shared], pad_id=0, device=CPU,
                                       shared_prompt=shared), G=4)
        assert _close_grads(got, ref)


@pytest.mark.parametrize("config_cls", [LlamaConfig, Qwen2Config])
def test_other_families(config_cls):
    model = _family(config_cls)
    prompt, responses = _group(vocab=96, P=6, lens=(4, 1, 7))
    ref_GT = _reference(model, prompt, responses)
    ref = _grads(model, split_group(prompt, responses, micro_batch_size=3, pad_id=0, device=CPU), G=3)
    for shared in (True, False):
        mbs = pack_group(prompt, responses, token_budget=UNBOUNDED, pad_id=0, device=CPU, shared_prompt=shared)
        assert torch.allclose(_logp_GT(model, mbs, G=3, T=7), ref_GT, **EQUAL)
        assert _close_grads(_grads(model, mbs, G=3), ref)


def _sliding(family: str, window: int | None):
    """A 2-layer model whose first layer slides over `window` positions (None: no window at all)."""
    from transformers import Gemma3TextConfig, MistralConfig

    sizes = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    if family == "gemma3":  # Gemma-3's layout: sliding layers and full ones
        config = Gemma3TextConfig(**sizes, head_dim=16, sliding_window=window or 256,
                                  layer_types=["sliding_attention" if window else "full_attention", "full_attention"])
    else:  # Mistral: every layer slides
        config = MistralConfig(**sizes, sliding_window=window)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).double()


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_sliding_window_layers_pack_and_equal_separate_rows(family):
    """A window of 3 positions, shorter than the prompt and the responses: packed rows (the prompt
    shared or not, one row or split) give the padded rows' log-probs and gradients; the window is by the
    positions the model sees (each response restarts at P), and it matters (no window: other values)."""
    model = _sliding(family, 3)
    prompt, responses = _group(vocab=96, P=6, lens=(4, 1, 7, 5))
    split = split_group(prompt, responses, micro_batch_size=4, pad_id=0, device=CPU)
    ref_GT, ref = _logp_GT(model, split, G=4, T=7), _grads(model, split, G=4)
    for shared in (True, False):
        for budgets in (NO_SPLIT, SPLIT):
            mbs = pack_group(prompt, responses, token_budget=budgets[shared], pad_id=0, device=CPU, shared_prompt=shared)
            assert torch.allclose(_logp_GT(model, mbs, G=4, T=7), ref_GT, **EQUAL), (shared, budgets)
            assert _close_grads(_grads(model, mbs, G=4), ref)
    unwindowed = _sliding(family, None)
    unwindowed.load_state_dict(model.state_dict())
    assert not torch.allclose(_logp_GT(unwindowed, split, G=4, T=7), ref_GT, atol=1e-3)


@pytest.mark.parametrize("tile", [1, 3])
def test_responses_in_query_tiles(monkeypatch, tile):
    # The blocks kernel tiles a response when P² >= R·TILE, else runs is_causal over [prompt, response]:
    # P=5 with R in 1..10 takes both paths at tile 3 and only tiles at tile 1.
    monkeypatch.setattr(packed_attention, "TILE", tile)
    model = _model(seed=0)
    prompt, responses = _group(vocab=model.config.vocab_size, P=5, lens=(10, 1, 3, 7))
    mbs = pack_group(prompt, responses, token_budget=UNBOUNDED, pad_id=0, device=CPU, shared_prompt=True)
    assert torch.allclose(_logp_GT(model, mbs, G=4, T=10), _reference(model, prompt, responses), **EQUAL)
    ref = _grads(model, split_group(prompt, responses, micro_batch_size=4, pad_id=0, device=CPU), G=4)
    assert _close_grads(_grads(model, mbs, G=4), ref)


def test_shared_prompt_mask_and_positions_by_hand():
    (mb,) = pack_group(torch.tensor([5, 6]), [torch.tensor([7, 8]), torch.tensor([9])], token_budget=UNBOUNDED,
                       pad_id=0, device=CPU, shared_prompt=True)
    assert mb.input_ids_1L.tolist() == [[5, 6, 7, 8, 9]] and mb.tokens == 5
    assert mb.position_ids_1L.tolist() == [[0, 1, 2, 3, 2]]
    assert mb.rows_K.tolist() == [1, 2, 1]  # 7 <- prompt end, 8 <- 7, 9 <- prompt end
    assert mb.pack.dense_LL(CPU).int().tolist() == [[1, 0, 0, 0, 0],
                                                    [1, 1, 0, 0, 0],
                                                    [1, 1, 1, 0, 0],
                                                    [1, 1, 1, 1, 0],
                                                    [1, 1, 0, 0, 1]]
    (mb,) = pack_group(torch.tensor([5, 6]), [torch.tensor([7]), torch.tensor([9])], token_budget=UNBOUNDED,
                       pad_id=0, device=CPU, shared_prompt=False)
    assert mb.input_ids_1L.tolist() == [[5, 6, 7, 5, 6, 9]] and mb.position_ids_1L.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert mb.pack.dense_LL(CPU)[3:, :3].sum() == 0 and mb.pack.dense_LL(CPU)[5].tolist() == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("backend", ["blocks", "dense"])
def test_a_wrong_mask_changes_the_result(backend):
    model = _model(seed=0)
    prompt, responses = _group(vocab=model.config.vocab_size, P=7, lens=(5, 4, 6))
    (mb,) = pack_group(prompt, responses, token_budget=UNBOUNDED, pad_id=0, device=CPU, shared_prompt=True,
                       backend=backend)
    right = mb.logprobs(model, temperature=TEMP)
    L = mb.tokens
    wrong_masks = [
        PackMask(seg_L=torch.zeros(L, dtype=torch.long), spans=((0, L),), shared=True, backend=backend),  # causal
        dataclasses.replace(mb.pack, shared=False),  # responses lose the prompt
    ]
    for wrong in wrong_masks:
        assert (dataclasses.replace(mb, pack=wrong).logprobs(model, temperature=TEMP) - right).abs().max() > 1e-2


def test_the_mask_reaches_attention_only_through_the_registered_mask_function(monkeypatch):
    model = _model(seed=0)
    prompt, responses = _group(vocab=model.config.vocab_size, P=7, lens=(5, 4, 6))
    ref_GT = _reference(model, prompt, responses)
    mbs = pack_group(prompt, responses, token_budget=UNBOUNDED, pad_id=0, device=CPU, shared_prompt=True)
    assert torch.allclose(_logp_GT(model, mbs, G=3, T=6), ref_GT, **EQUAL)
    # The trap: for a custom attention name with no mask function, transformers hands the layers
    # attention_mask=None, silently; our kernel then sees a plain causal row.
    monkeypatch.delitem(AttentionMaskInterface._global_mapping, ATTN_NAME)
    assert (_logp_GT(model, mbs, G=3, T=6) - ref_GT).abs().max() > 1e-2


def test_install_leaves_unpacked_forwards_bit_identical():
    model = _model(seed=0)
    ids = torch.tensor([[3, 4, 5, 6, 7], [0, 0, 8, 9, 10]])  # the second row left-padded, as in generation
    attn = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    prompt, responses = _group(vocab=model.config.vocab_size, P=7, lens=(5, 1, 3))
    before = model(input_ids=ids, attention_mask=attn).logits, _reference(model, prompt, responses)
    install(model)
    install(model)  # idempotent
    assert model.config._attn_implementation == ATTN_NAME
    after = model(input_ids=ids, attention_mask=attn).logits, _reference(model, prompt, responses)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_install_needs_sdpa():
    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="sdpa"):
        install(AutoModelForCausalLM.from_config(config))


def test_activation_checkpointing_replays_the_packed_mask():
    model = _model(seed=0)
    prompt, responses = _group(vocab=model.config.vocab_size, P=7, lens=(5, 1, 9))
    ref = _grads(model, split_group(prompt, responses, micro_batch_size=3, pad_id=0, device=CPU), G=3)
    apply_ac(model)  # the trainer's own per-layer checkpointing (trainer.activation_checkpointing)
    mbs = pack_group(prompt, responses, token_budget=UNBOUNDED, pad_id=0, device=CPU, shared_prompt=True)
    assert _close_grads(_grads(model, mbs, G=3), ref)


def test_flex_block_mask_forward_on_cpu():
    pytest.importorskip("torch.nn.attention.flex_attention")
    model = _model(seed=0)
    prompt, responses = _group(vocab=model.config.vocab_size, P=7, lens=(5, 1, 3))
    ref_GT = _reference(model, prompt, responses)
    for shared in (True, False):
        mbs = pack_group(prompt, responses, token_budget=UNBOUNDED, pad_id=0, device=CPU, shared_prompt=shared,
                         backend="flex")
        # flex has no CPU backward and warns that it runs uncompiled: forward only, quietly
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert torch.allclose(_logp_GT(model, mbs, G=3, T=5), ref_GT, **EQUAL)


def test_budget_splits_by_sample_index():
    prompt = torch.arange(4)
    responses = [torch.arange(R) for R in (3, 4, 5, 2, 20)]

    def split(shared, budget):
        mbs = pack_group(prompt, responses, token_budget=budget, pad_id=0, device=CPU, shared_prompt=shared)
        return [mb.samples for mb in mbs], [mb.tokens for mb in mbs]

    # shared rows cost P + sum(R): 4+3+4 | 4+5+2 | 4+20 (alone, over budget: a response cannot split)
    assert split(True, 12) == ([(0, 1), (2, 3), (4,)], [11, 11, 24])
    # varlen rows cost sum(P + R): 7+8 | 9+6 | 24
    assert split(False, 16) == ([(0, 1), (2, 3), (4,)], [15, 15, 24])
    assert split(True, UNBOUNDED) == ([(0, 1, 2, 3, 4)], [38])
    assert split(True, 12) == split(True, 12)  # a function of the group alone


def test_make_micro_batches_dispatch():
    prompt, responses = _group(vocab=96, P=40, lens=(3, 4, 5))
    long_responses = _group(vocab=96, P=1, lens=(30, 40, 50))[1]
    kw = dict(token_budget=UNBOUNDED, micro_batch_size=2, pad_id=0, device=CPU)
    padded = make_micro_batches(prompt, responses, mode="padded", **kw)
    assert [type(mb) for mb in padded] == [MicroBatch, MicroBatch] and padded[0].samples == (0, 1)
    on, off, auto = (make_micro_batches(prompt, responses, mode=m, **kw) for m in ("on", "off", "auto"))
    assert all(type(mb) is PackedMicroBatch for mb in on + off + auto)
    assert on[0].pack.shared and not off[0].pack.shared and auto[0].pack.shared  # 80/132 tokens saved
    assert on[0].tokens == 52 and off[0].tokens == 132
    short = make_micro_batches(prompt[:1], long_responses, mode="auto", **kw)
    assert not short[0].pack.shared  # 2/123 < AUTO_MIN_SAVED
    with pytest.raises(ValueError, match="shared_prompt"):
        make_micro_batches(prompt, responses, mode="sometimes", **kw)
    with pytest.raises(ValueError, match="token_budget"):
        make_micro_batches(prompt, responses, mode="on", **{**kw, "token_budget": 0})
    with pytest.raises(ValueError, match="non-empty prompt"):
        make_micro_batches(prompt[:0], responses, mode="off", **kw)
    with pytest.raises(ValueError, match="backend"):
        make_micro_batches(prompt, responses, mode="on", backend="fast", **kw)


def test_auto_rule():
    assert auto_shared_prompt(1000, [100] * 8) and auto_shared_prompt(200, [50] * 8)
    assert auto_shared_prompt(50, [500] * 8)  # saves 0.08
    assert not auto_shared_prompt(10, [500] * 8)  # saves 0.017
    assert not auto_shared_prompt(1000, [10])  # G=1: nothing to share


def _fusion_attention_tnd(q_TND, k_TND, v_TND, ends_q, ends_kv, *, scale):
    """torch_npu.npu_fusion_attention(input_layout="TND", sparse_mode=3) as Ascend documents it
    (it cannot run here): segment i is rows ends[i-1]:ends[i] of the queries and of the keys; its
    queries attend its keys causally aligned to the bottom right (query j sees keys up to
    Skv - Sq + j); fewer key/value heads than query heads are shared in groups (GQA)."""
    outs, q0, k0 = [], 0, 0
    for q1, k1 in zip(ends_q, ends_kv):
        q, k, v = (x.transpose(0, 1) for x in (q_TND[q0:q1], k_TND[k0:k1], v_TND[k0:k1]))  # [N, S, D]
        groups = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        Sq, Skv = q.shape[1], k.shape[1]
        allowed = torch.ones(Sq, Skv, dtype=torch.bool).tril(diagonal=Skv - Sq)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale))
        q0, k0 = q1, k1
    return torch.cat(outs, dim=1)  # [N, L, D]


@pytest.mark.parametrize("shared", [True, False])
def test_npu_varlen_layout_equals_the_dense_mask(shared):
    """The npu backend hands npu_fusion_attention TND segments, not an [L, L] mask; under the
    kernel's documented semantics those segments give the dense mask's attention exactly."""
    g = torch.Generator().manual_seed(0)
    prompt, responses = _group(vocab=96, P=6, lens=(4, 1, 7))
    mb = pack_group(prompt, responses, token_budget=UNBOUNDED, pad_id=0, device=CPU, shared_prompt=shared)[0]
    L, H, H_kv, D = mb.pack.seg_L.numel(), 4, 2, 8
    q = torch.randn(1, H, L, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, H_kv, L, D, generator=g, dtype=torch.float64) for _ in range(2))
    q_TND, k_TND, v_TND, ends_q, ends_kv = packed_attention.tnd_segments(q, k, v, mb.pack)
    assert ends_q[-1] == L and k_TND.shape[1] == H_kv  # every query once; KV heads stay grouped
    if shared:  # the prompt's keys in front of each response's: P + sum(P + R)
        assert ends_kv[-1] == 6 + sum(6 + R for R in (4, 1, 7))
    got = _fusion_attention_tnd(q_TND, k_TND, v_TND, ends_q, ends_kv, scale=D ** -0.5)
    want = packed_attention._dense(q, k, v, H // H_kv, mb.pack, scaling=D ** -0.5, dropout=0.0)[0]
    assert torch.allclose(got, want, **EQUAL)
