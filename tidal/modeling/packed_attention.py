"""Attention over one packed row: the shared-prompt / varlen mask, its kernels, and the HF hook.

One description, `PackMask.mask_mod(b, h, q_idx, kv_idx)` over per-token segment ids, is the mask;
each backend turns it into what its kernel wants:
  blocks: exact block-sparse SDPA, the default off Ascend: the prompt once, causal; each response
          over [prompt keys, its own keys] (in query tiles, or for a short prompt is_causal over
          [prompt, response]), so attention costs ~P² + Σ R_i (P + R_i) instead of L²
  dense:  a boolean [L, L] mask for SDPA (CPU and CUDA), the reference the others are tested against
  flex:   a flex-attention BlockMask (CUDA only: flex has no CPU backward), opt-in
  npu:    torch_npu.npu_fusion_attention on varlen TND segments (no [L, L] mask), the default on Ascend
A sliding-window layer (Gemma-3, Mistral) adds the window by the positions the model sees (a shared
prompt's responses all restart at P) and runs dense on every backend (`_windowed`).

Hook: the model runs under our attention name. transformers builds the mask once per forward
through the mask function registered for the model's attention name; an unregistered custom name
silently hands every layer `attention_mask=None` (the trap). So we register both, and while a packed
forward runs our mask function hands the layers the row's `PackMask` instead of a tensor; otherwise
both delegate to the stock SDPA mask and kernel, so unpadded/padded calls are bit-identical.
"""
from __future__ import annotations

import itertools
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

ATTN_NAME = "tidal_packed"
Backend = Literal["auto", "blocks", "dense", "flex", "npu"]
BACKENDS = ("auto", "blocks", "dense", "flex", "npu")


@dataclass(frozen=True, eq=False)
class PackMask:
    """Who sees whom in one packed row (batch dim 1). Segments are contiguous, in order, cover the row."""
    seg_L: torch.Tensor  # long, segment id of each token
    spans: tuple[tuple[int, int], ...]  # [start, end) of each non-empty segment
    shared: bool  # segment 0 (spans[0]) is a prompt that every later segment sees whole
    backend: Backend = "auto"
    # each token's position as the model sees it (a shared prompt's responses all restart at P): a
    # sliding-window layer's window is over these; None: the row's own indices
    pos_L: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, init=False, repr=False)  # masks built once per row

    @property
    def mask_mod(self):
        """(b, h, q_idx, kv_idx) -> True where the query may attend the key: flex's signature (a plain
        function of 4 arguments: flex counts them), and it broadcasts over index grids for the dense mask."""
        seg, shared = self.seg_L, self.shared

        def mask_mod(b, h, q_idx, kv_idx):
            mine = seg[q_idx] == seg[kv_idx]
            if shared:
                # prompt keys precede every response token, so `kv <= q` keeps prompt rows causal only
                mine = mine | (seg[kv_idx] == 0)
            return (kv_idx <= q_idx) & mine

        return mask_mod

    def dense_LL(self, device: torch.device) -> torch.Tensor:
        key = ("dense", str(device))
        if key not in self._cache:
            idx = torch.arange(self.seg_L.numel(), device=device)
            self._cache[key] = self.mask_mod(None, None, idx[:, None], idx[None, :])
        return self._cache[key]

    def windowed_LL(self, window: int, device: torch.device) -> torch.Tensor:
        """dense_LL, and a key only within `window` positions of the query (HF's sliding window:
        q - k < window, by the positions the model sees, not by place in the row)."""
        key = ("window", window, str(device))
        if key not in self._cache:
            pos = (self.pos_L if self.pos_L is not None else torch.arange(self.seg_L.numel())).to(device)
            self._cache[key] = self.dense_LL(device) & (pos[:, None] - pos[None, :] < window)
        return self._cache[key]

    @property
    def length(self) -> int:
        """The row's tokens: the query and key length a forward over it has."""
        return self.seg_L.numel()

    def attend(self, q_1HLD, k_1KLD, v_1KLD, *, scaling: float, dropout: float = 0.0, window: int | None = None):
        """What a layer computes over the row (`attend` below); a context-parallel share of a row answers the same
        call (tidal/modeling/parallel/cp.py ContextRows)."""
        return attend(q_1HLD, k_1KLD, v_1KLD, self, scaling=scaling, dropout=dropout, window=window)

    def resolved_backend(self, device: torch.device) -> str:
        if self.backend != "auto":
            return self.backend
        return "npu" if device.type == "npu" else "blocks"


_ACTIVE: ContextVar[PackMask | None] = ContextVar("tidal_pack_mask", default=None)


@contextmanager
def scoped(var: ContextVar, value):
    """`var` holds `value` within this block (per call, thread/task-local): how a forward hands its layout to the
    attention and mask functions transformers calls (here, and the engine's slots: tidal/modeling/slot_attention.py)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def packed_forward(pack: PackMask):
    """Within this block, forwards of installed models attend through `pack`."""
    return scoped(_ACTIVE, pack)


def active_pack() -> PackMask | None:
    """The packed row a forward runs over now, if any (exact attention reads it too: tidal/modeling/numerics.py)."""
    return _ACTIVE.get()


def _mask(*args, **kwargs):
    pack = _ACTIVE.get()
    if pack is None:
        return sdpa_mask(*args, **kwargs)
    assert kwargs["q_length"] == kwargs["kv_length"] == pack.length, "a packed forward has no cache"
    # Handed to every layer as `attention_mask`; also what activation checkpointing replays.
    return pack


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    if query.dtype in (torch.bfloat16, torch.float16) and query.device.type == "cpu":
        # scores, softmax and both products in float32: a low-precision kernel rounds its softmax
        # weights, and differently for each query tiling (a packed row, a padded one, one decoded
        # token), so the generator's and the trainer's bf16 forwards drifted apart layer by layer
        # (bench/bf16_gap.py); the projections around it stay in bf16. Measured on CPU only: on a
        # GPU/NPU the fused bf16 kernels keep their speed and memory (the NPU's is bf16/fp16 only).
        if isinstance(attention_mask, torch.Tensor) and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        out, weights = _attention(module, query.float(), key.float(), value.float(), attention_mask,
                                  dropout=dropout, scaling=scaling, **kwargs)
        return out.to(query.dtype), weights
    if attention_mask is None or isinstance(attention_mask, torch.Tensor):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    assert query.shape[0] == 1, "a packed row has batch size 1"
    # the row's PackMask, or a context-parallel rank's share of it (ContextRows)
    out_1HLD = attention_mask.attend(query, key, value, scaling=scaling, dropout=dropout,
                                     window=kwargs.get("sliding_window"))
    return out_1HLD.transpose(1, 2).contiguous(), None


# Query tile of the blocks kernel: each tile computes ~TILE²/2 masked scores for nothing; 128 and
# 256 measured alike on CPU (bench/shared_prompt.py, P=100 R=1000 and P=1000 R=100).
TILE = 128


def _blocks(q, k, v, groups, pack, *, scaling, dropout):
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    # split, not slicing: backward then writes each segment's gradient once (one cat), where every
    # slice would zero-fill and add a full-row gradient (a few per cent of a step in the profile).
    sizes = [e - s for s, e in pack.spans]
    assert sum(sizes) == q.shape[2], "spans cover the row"
    qs, ks, vs = (x.split(sizes, dim=2) for x in (q, k, v))

    def sdpa(q_, k_, v_, **kw):
        return F.scaled_dot_product_attention(q_, k_, v_, dropout_p=dropout, scale=scaling, **kw)

    if not pack.shared:
        return torch.cat([sdpa(*qkv, is_causal=True) for qkv in zip(qs, ks, vs)], dim=2)
    P = sizes[0]
    assert pack.spans[0] == (0, P)
    outs = [sdpa(qs[0], ks[0], vs[0], is_causal=True)]
    for q_R, k_R, v_R in zip(qs[1:], ks[1:], vs[1:]):
        # Exact: the keys a response may not see are absent rather than masked.
        kk, vv = torch.cat([ks[0], k_R], dim=2), torch.cat([vs[0], v_R], dim=2)
        R = q_R.shape[2]
        if P * P < R * TILE:
            # Short prompt: is_causal over [prompt, response], dropping the recomputed prompt rows,
            # costs (P+R)²/2 scores: fewer than the tiles' PR + R²/2 + R·TILE/2 once P² < R·TILE.
            outs.append(sdpa(torch.cat([qs[0], q_R], dim=2), kk, vv, is_causal=True).split([P, R], dim=2)[1])
            continue
        # An explicit mask makes SDPA compute every masked score too (only is_causal skips them),
        # so the response goes in query tiles that each see only the keys up to their own end.
        for a, q_t in zip(range(0, R, TILE), q_R.split(TILE, dim=2)):
            b = a + q_t.shape[2]
            outs.append(sdpa(q_t, kk[:, :, :P + b], vv[:, :, :P + b],
                             attn_mask=_prefix_causal(pack, P + a, b - a, q.device)))
    return torch.cat(outs, dim=2)


def _prefix_causal(pack: PackMask, P: int, R: int, device) -> torch.Tensor:
    """[R, P + R]: the whole prompt, then causal over the response itself."""
    key = ("prefix", P, R, str(device))
    if key not in pack._cache:
        m = torch.ones(R, P + R, dtype=torch.bool, device=device)
        m[:, P:] = torch.ones(R, R, dtype=torch.bool, device=device).tril()
        pack._cache[key] = m
    return pack._cache[key]


def _dense(q, k, v, groups, pack, *, scaling, dropout, mask_LL=None):
    """mask_LL: another [L, L] mask than the pack's (a sliding window's, `_windowed`)."""
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    mask_LL = pack.dense_LL(q.device) if mask_LL is None else mask_LL
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_LL, dropout_p=dropout, scale=scaling)


def _flex(q, k, v, groups, pack, *, scaling, dropout):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        raise ValueError("backend 'flex' needs torch.nn.attention.flex_attention") from e
    if dropout:
        raise ValueError("backend 'flex' does not support attention dropout")
    key = ("flex", str(q.device))
    if key not in pack._cache:
        L = q.shape[2]
        pack._cache[key] = create_block_mask(pack.mask_mod, B=None, H=None, Q_LEN=L, KV_LEN=L, device=q.device)
    fn = flex_attention
    if q.device.type == "cuda":
        # Uncompiled flex materialises the scores; compiled it skips masked blocks.
        fn = _COMPILED.setdefault("flex", torch.compile(flex_attention, dynamic=True))
    return fn(q, k, v, block_mask=pack._cache[key], scale=scaling, enable_gqa=groups > 1)


def tnd_segments(q, k, v, pack: PackMask):
    """The row in npu_fusion_attention's varlen layout: [tokens, heads, dim] tensors holding every
    segment back to back, and the cumulative ends of the query and key segments
    (`actual_seq_qlen`, `actual_seq_kvlen`). Each segment attends its own keys bottom-right causally
    (sparse_mode 3): a varlen row's segments are plain causal blocks; with a shared prompt the
    prompt's keys are repeated in front of each response's, so a response sees the whole prompt and
    its own past. Memory: the keys and values once plus (G-1) prompt copies, instead of an [L, L] mask."""
    sizes = [e - s for s, e in pack.spans]
    q_TND, k_TND, v_TND = (x[0].transpose(0, 1) for x in (q, k, v))
    kv_sizes = sizes
    if pack.shared:
        P, ks, vs = sizes[0], k_TND.split(sizes), v_TND.split(sizes)
        k_TND = torch.cat([ks[0], *(t for k_R in ks[1:] for t in (ks[0], k_R))])
        v_TND = torch.cat([vs[0], *(t for v_R in vs[1:] for t in (vs[0], v_R))])
        kv_sizes = [P] + [P + R for R in sizes[1:]]
    return q_TND, k_TND, v_TND, list(itertools.accumulate(sizes)), list(itertools.accumulate(kv_sizes))


def _npu(q, k, v, groups, pack, *, scaling, dropout):
    # Ascend only: the layout (tnd_segments) is tested on CPU against the documented semantics of
    # the kernel (tests/test_packing.py), the kernel itself was not run here.
    try:
        import torch_npu
    except ImportError as e:
        raise ValueError("backend 'npu' needs torch_npu") from e
    q_TND, k_TND, v_TND, ends_q, ends_kv = tnd_segments(q, k, v, pack)  # k/v keep their KV heads (GQA)
    key = ("npu-causal", str(q.device))
    if key not in pack._cache:  # sparse_mode 3 takes this compressed 2048 x 2048 mask (True = masked)
        pack._cache[key] = torch.ones(2048, 2048, dtype=torch.bool, device=q.device).triu(diagonal=1)
    out_TND = torch_npu.npu_fusion_attention(
        q_TND, k_TND, v_TND, q.shape[1], input_layout="TND", atten_mask=pack._cache[key],
        scale=scaling if scaling is not None else q.shape[-1] ** -0.5, keep_prob=1.0 - dropout,
        actual_seq_qlen=ends_q, actual_seq_kvlen=ends_kv, sparse_mode=3)[0]
    return out_TND.transpose(0, 1)[None]


_KERNELS = {"blocks": _blocks, "dense": _dense, "flex": _flex, "npu": _npu}


def _windowed(q, k, v, groups, pack, *, window, scaling, dropout):
    """A sliding-window layer (Gemma-3's 5 of 6, Mistral's): the dense mask with the window, on every
    backend. Dense costs L² scores where blocks skips the masked ones; a kernel with the window in its
    blocks is left for when a model spends its time here."""
    return _dense(q, k, v, groups, pack, scaling=scaling, dropout=dropout, mask_LL=pack.windowed_LL(window, q.device))


def attend(q_1HLD: torch.Tensor, k_1KLD: torch.Tensor, v_1KLD: torch.Tensor, pack: PackMask, *, scaling: float,
           dropout: float = 0.0, window: int | None = None) -> torch.Tensor:
    """Attention over one packed row (H query heads over K key/value heads) with the pack's kernel: [1, H, L, D].
    window: a sliding-window layer's (q - k < window by position). The HF hook below and the megatron
    backend (tidal/modeling/megatron/forward.py) both call it."""
    groups = q_1HLD.shape[1] // k_1KLD.shape[1]
    if window is not None:
        return _windowed(q_1HLD, k_1KLD, v_1KLD, groups, pack, window=window, scaling=scaling, dropout=dropout)
    return _KERNELS[pack.resolved_backend(q_1HLD.device)](
        q_1HLD, k_1KLD, v_1KLD, groups, pack, scaling=scaling, dropout=dropout)
_COMPILED: dict = {}

AttentionInterface.register(ATTN_NAME, _attention)
AttentionMaskInterface.register(ATTN_NAME, _mask)
assert ALL_MASK_ATTENTION_FUNCTIONS[ATTN_NAME] is _mask


def install(model) -> None:
    """Route `model`'s attention through ours (idempotent). Only from SDPA: off a packed forward it *is* SDPA.

    Persistent rather than per call: activation checkpointing replays layer forwards during backward,
    after any per-call switch would have been undone.
    """
    impl = model.config._attn_implementation
    if impl == ATTN_NAME:
        return
    if impl != "sdpa":
        raise ValueError(f"shared-prompt / varlen packing needs a model loaded with attn_implementation='sdpa', "
                         f"got {impl!r}")
    model.set_attn_implementation(ATTN_NAME)
