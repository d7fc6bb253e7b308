"""A micro-batch's response log-probs through megatron-core's GPTModel: the same MicroBatch /
PackedMicroBatch the torch backend takes, the same chunked LM head (tidal/modeling/head.py).

- padded rows [prompt, r_i]: a causal mask (right padding sits after every real token);
- packed rows (varlen, shared prompt): the row's PackMask, which each layer's core attention hands
  to the torch backend's packed kernels (install_packed_attention), and the row's own positions. megatron's RoPE
  numbers positions 0..L-1 along the row and takes no position_ids; a shared row needs every
  response to restart at position P, so a hook on the rotary embedding picks, for each token, the
  row of megatron's own table at the token's position (the same bits megatron computes there).

The head runs through a hook on `output_layer`, inside GPTModel's own forward, as the torch
backend's does on `lm_head`: megatron's decoder, final norm and rotary set-up run as megatron runs
them. The head's logits stay vocabulary-parallel: each tp rank computes its slice [C, V/tp] and the
log-softmax is joined over tp from three [C] vectors (vocab_parallel.py).
"""
from __future__ import annotations

import functools

import torch

from tidal.modeling.megatron.vocab_parallel import chunk_logprobs
from tidal.modeling.batching import MicroBatch, ResponseLogprobs
from tidal.modeling.head import head_logprobs
from tidal.modeling.packed_attention import PackMask, attend
from tidal.modeling.packing import PackedMicroBatch


def _inputs(mb) -> tuple[torch.Tensor, torch.Tensor | PackMask]:
    """(input_ids [B, L], the attention mask): padded rows get megatron's convention, [1, 1, L, L] bool,
    True = not attended; a packed row its PackMask, which the packed core attention reads."""
    if isinstance(mb, PackedMicroBatch):
        return mb.input_ids_1L, mb.pack
    ids_BL = mb.input_ids_NL
    L = ids_BL.shape[1]
    return ids_BL, ~torch.ones(L, L, dtype=torch.bool, device=ids_BL.device).tril()[None, None]


def install_packed_attention(model) -> None:
    """Each layer's core attention runs a packed row with tidal/modeling/packed_attention.py's kernels
    when it is handed the row's PackMask as its mask (blocks by default: ~P² + Σ R_i (P + R_i) scores, not
    a dense [L, L] over the whole row), and megatron's own attention otherwise. Persistent and
    idempotent: megatron's activation recompute replays a layer with the same arguments later."""
    for layer in model.decoder.layers:
        core = layer.self_attention.core_attention
        if getattr(core, "tidal_packed", False):
            continue

        def forward(query, key, value, attention_mask, *args, own=core.forward, scale=core.softmax_scale, **kwargs):
            if not isinstance(attention_mask, PackMask):
                return own(query, key, value, attention_mask, *args, **kwargs)
            # megatron's [L, 1, heads, D] <-> the kernels' [1, heads, L, D]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out_1HLD = attend(q, k, v, attention_mask, scaling=scale)
            return out_1HLD.permute(2, 0, 1, 3).reshape(query.shape[0], 1, -1)

        core.forward, core.tidal_packed = forward, True


def _select(mb, h_BLH: torch.Tensor) -> torch.Tensor:
    """The hidden states that predict each real response token, in mask_NT order: [K, H]."""
    if isinstance(mb, PackedMicroBatch):
        return h_BLH[0, mb.rows_K]
    assert isinstance(mb, MicroBatch)
    T = mb.targets_NT.shape[1]
    return h_BLH[:, mb.prompt_len - 1: mb.prompt_len - 1 + T][mb.mask_NT]


def response_logprobs(model, mb, *, temperature: float, chunk: int, entropy: bool = False) -> ResponseLogprobs:
    """[N, T] float32 log-probs (and entropy) of `mb`'s response tokens under a GPTModel (packed rows:
    one with install_packed_attention)."""
    head, out, active = model.output_layer, [], [True]
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None

    def logits(h_CH):  # one chunk's logits of this rank's vocabulary slice, [C, V/tp]
        return head(h_CH[:, None], weight=weight, runtime_gather_output=False)[0][:, 0]

    # this rank's first vocabulary row (a last pipeline stage holds the head without the embedding)
    start = (model.embedding.word_embeddings.vocab_start_index if model.pre_process
             else head.output_size_per_partition * torch.distributed.get_rank(head.tp_group))
    per_chunk = functools.partial(chunk_logprobs, start=start, group=head.tp_group)

    def take_input(module, args, kwargs):
        if not active[0]:
            return None
        (h_LBH,) = args
        active.append(_select(mb, h_LBH.transpose(0, 1)))
        return (h_LBH[:1],), kwargs  # one row reaches megatron's own head call; nothing reads it

    def compute(module, args, kwargs, output):
        if not active[0]:
            return None
        active[0] = False
        out.append(head_logprobs(logits, active.pop(), mb.targets_NT[mb.mask_NT], temperature=temperature,
                                 chunk=chunk, entropy=entropy, per_chunk=per_chunk))
        return None

    handles = [head.register_forward_pre_hook(take_input, with_kwargs=True, prepend=True),
               head.register_forward_hook(compute, with_kwargs=True)]
    try:
        _run(model, mb)
    finally:
        for handle in handles:
            handle.remove()
    return ResponseLogprobs.scatter(out[0], mb.mask_NT)


def _run(model, mb) -> torch.Tensor:
    ids_BL, mask = _inputs(mb)
    pos_BL = torch.arange(ids_BL.shape[1], device=ids_BL.device)[None].expand_as(ids_BL)
    handle = None
    if isinstance(mb, PackedMicroBatch):  # emb_L11D: megatron's table for positions 0..L-1, picked per token
        pos_L = mb.position_ids_1L[0]
        handle = model.rotary_pos_emb.register_forward_hook(lambda module, args, emb_L11D: emb_L11D[pos_L])
    try:
        return model(input_ids=ids_BL, position_ids=pos_BL, attention_mask=mask)
    finally:
        if handle is not None:
            handle.remove()


def stage_hidden(model, mb) -> torch.Tensor:
    """A pipeline stage before the last (tidal/modeling/megatron/pipeline.py): its output hidden states
    [L, B, H] for `mb` (from the token ids on the first stage, else from the input set with
    model.set_input_tensor)."""
    return _run(model, mb)


def hidden_shape(mb, hidden: int) -> tuple[int, int, int]:
    """The [L, B, H] hidden states a stage hands the next for `mb` (megatron is sequence-first)."""
    ids_BL, _ = _inputs(mb)
    return ids_BL.shape[1], ids_BL.shape[0], hidden
