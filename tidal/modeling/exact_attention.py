"""Exact attention (model.numerics=exact): a query's output has the same bits whatever else its forward holds.

The rule of tidal/modeling/numerics.py, applied to attention: every library call has one fixed shape. The work of a
forward is cut into *items*: one tile of ATTN_ROWS query rows (the query heads of one key head, query by query,
zero rows after the last) against one chunk of KEY_CHUNK key slots. A sequence's key slots hold its keys by
logical position (slot j: the key at position j; with a shared prompt, the prompt's keys and then the response's
own), so a decode step over a cache, a left-padded prefill, the trainer's shared-prompt row and its varlen and
padded rows put a token's keys in the same slots. Items go to the library ATTN_ITEMS at a time, the last call
padded with empty items: every call is `bmm([ATTN_ITEMS, ATTN_ROWS, D], [ATTN_ITEMS, D, KEY_CHUNK])` and
`bmm([ATTN_ITEMS, ATTN_ROWS, KEY_CHUNK], [ATTN_ITEMS, KEY_CHUNK, D])`, in float32, and the elementwise work
between them (scaling, the mask, exp, the sum of a row's weights) runs on tensors of that one shape too.

Why that gives a row the same bits in any batch:
  * a call's arithmetic for an output element is fixed by the call's shape, strides and dtype (and the thread
    count, the same on every rank of a node: tidal/controller/devices.py): the library has nothing else to choose its
    kernel, blocking or split of the reduction by. Every call here has the one shape above, operands freshly
    gathered (contiguous, 64-byte aligned), whatever the batch: so a row meets its keys in the same arithmetic;
  * a row's max over its visible scores is exact in any order; exp(score - max), its weights' sum over a chunk and
    the chunk's weighted values come out of the fixed-shape calls;
  * the chunks' results are added in slot order (chunk 0, 1, 2, ...), one add per chunk, so the sum's order is the
    row's own; chunks past a row's position are not computed (their weights would be exactly 0, adding nothing);
  * a row's output is acc / total, elementwise.
Rows of a tile, and tiles of an item, do not interact: a row's output depends on its own query, its own keys and
values and its own position, in a fixed sequence of fixed-shape operations.

Backward: the trainer's gradient need not match anything bit for bit (only its log-probs must match the
sampler's), so it is the default kernels' (tidal/modeling/packed_attention.py for a packed row, SDPA with the same
mask for padded rows), recomputed in the backward from the saved queries, keys and values as flash attention
does: the items' gathered keys are never kept for autograd.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from tidal.modeling.packed_attention import PackMask, active_pack
from tidal.modeling.packed_attention import _attention as packed_attention

ATTN_NAME = "tidal_exact"
KEY_CHUNK = 64  # key slots an item reduces over: the fixed reduction length of the value product
ATTN_ROWS = 8  # query rows of an item, the M of every attention product: a decode step's query heads of a key head (3-8)
ATTN_ITEMS = 64  # items a library call takes (bench/exact_kernels.py measured 32-256)
BLOCK_ITEMS = 4096  # items of one block: what bounds the gathered keys and the scores a long row holds at once


@dataclass(eq=False)
class _Keys:
    """A padded batch's layout (the engine's prefill and decode, the trainer's padded rows): which key columns
    are real (`valid_BS`, None: all) and how many of the last columns are queries."""
    valid_BS: torch.Tensor | None
    q_length: int
    kv_length: int
    _cache: dict = field(default_factory=dict, repr=False)


def _mask(*args, **kwargs):
    """What every layer of a forward gets as its `attention_mask`: a packed row's PackMask, or the padded batch's
    _Keys (built once per forward by transformers, so the plan below is built once per forward)."""
    pack = active_pack()
    if pack is not None:
        return pack
    mask = kwargs.get("attention_mask")
    if mask is not None:
        assert mask.dim() == 2, "exact attention takes a 2-D padding mask"
        mask = mask.bool()
    return _Keys(mask, kwargs["q_length"], kwargs["kv_length"])


@dataclass(frozen=True)
class _Seqs:
    """The forward's sequences: each is a batch row's queries (their columns among the call's W query columns,
    and their logical positions: -1 sees nothing) and its key slots (slot j: the column of the key at logical
    position j; -1: empty). Padded with -1."""
    b_N: torch.Tensor
    qcol_NQ: torch.Tensor
    qpos_NQ: torch.Tensor
    kcol_NK: torch.Tensor
    kb_N: torch.Tensor | None = None  # the batch row of its keys, where not its queries' (the engine's slot cache)


def _padded_positions(keys: _Keys, B: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """valid_BS (a real key column), kpos_BS (its logical position), qpos_BW (each query column's; -1: padding)."""
    S, W = keys.kv_length, keys.q_length
    valid_BS = keys.valid_BS[:, -S:].to(device) if keys.valid_BS is not None else \
        torch.ones(B, S, dtype=torch.bool, device=device)
    kpos_BS = valid_BS.long().cumsum(1) - 1
    return valid_BS, kpos_BS, torch.where(valid_BS[:, S - W:], kpos_BS[:, S - W:], -1)


def _padded_seqs(keys: _Keys, B: int, device) -> _Seqs:
    S, W = keys.kv_length, keys.q_length
    valid_BS, kpos_BS, qpos_BW = _padded_positions(keys, B, device)
    K = max(int(valid_BS.sum(1).max()), 1)
    kcol = torch.full((B, K + 1), -1, dtype=torch.long, device=device)
    kcol.scatter_(1, torch.where(valid_BS, kpos_BS, K), torch.arange(S, device=device).expand(B, S))
    return _Seqs(torch.arange(B, device=device), torch.arange(W, device=device).expand(B, W), qpos_BW, kcol[:, :K])


def _packed_seqs(pack: PackMask, device) -> _Seqs:
    """A packed row's segments: a varlen segment attends its own tokens; with a shared prompt a response attends
    the prompt's tokens, then its own (logical positions P, P+1, ...)."""
    P = pack.spans[0][1] if pack.shared else 0
    seqs = []
    for s, (a, e) in enumerate(pack.spans):
        own = list(range(a, e))
        seqs.append((own, list(range(P, P + e - a)), list(range(P)) + own) if pack.shared and s > 0 else
                    (own, list(range(e - a)), own))

    def rows(lists):
        width = max(len(x) for x in lists)
        return torch.tensor([x + [-1] * (width - len(x)) for x in lists], dtype=torch.long, device=device)

    return _Seqs(torch.zeros(len(seqs), dtype=torch.long, device=device), rows([q for q, _, _ in seqs]),
                 rows([p for _, p, _ in seqs]), rows([k for _, _, k in seqs]))


@dataclass(frozen=True)
class _Call:
    """One library call's items: each item's tile (0 for a padding item), its key slots' rows in the call's
    [B*J*S] keys (0 where empty), flat, and which slots each tile row may not see."""
    tile_I: torch.Tensor
    kidx_X: torch.Tensor
    hidden_IAC: torch.Tensor


@dataclass(frozen=True)
class _Block:
    """Tiles and their items. rows_TA: each tile row's query row in the call's [B*W*H] rows (-1: a zero row).
    Items are chunk-major (every tile's chunk 0, then chunk 1, ...; `chunks` holds where each chunk's items
    start and end, a tile appearing once in each) and go to the library ATTN_ITEMS a call, the last call
    padded with items that see nothing."""
    rows_TA: torch.Tensor
    calls: tuple[_Call, ...]
    chunks: tuple[tuple[int, int], ...]
    tile_I: torch.Tensor  # every item's tile, padding included


def _plan(seqs: _Seqs, *, H: int, J: int, W: int, S: int) -> list[_Block]:
    dev, g, A = seqs.b_N.device, H // J, ATTN_ROWS
    Q_N = (seqs.qcol_NQ >= 0).sum(1)
    tiles_N = -(-g * Q_N // A)  # per key head
    n_T = torch.repeat_interleave(torch.arange(len(Q_N), device=dev), J * tiles_N)
    u_T = torch.arange(len(n_T), device=dev) - (torch.cumsum(J * tiles_N, 0) - J * tiles_N)[n_T]
    j_T, t_T = u_T // tiles_N[n_T], u_T % tiles_N[n_T]
    r_TA = t_T[:, None] * A + torch.arange(A, device=dev)  # a key head's rows: query-major, its g heads each
    real_TA = r_TA < (g * Q_N)[n_T][:, None]
    i_TA = (r_TA // g).clamp(max=seqs.qcol_NQ.shape[1] - 1)
    qcol_TA, qpos_TA = seqs.qcol_NQ[n_T[:, None], i_TA], seqs.qpos_NQ[n_T[:, None], i_TA]
    b_T = seqs.b_N[n_T]
    kb_T = b_T if seqs.kb_N is None else seqs.kb_N[n_T]
    rows_TA = torch.where(real_TA, (b_T[:, None] * W + qcol_TA) * H + j_T[:, None] * g + r_TA % g, -1)
    pos_TA = torch.where(real_TA, qpos_TA, -1)
    top_T = pos_TA.max(1).values
    chunks_T = torch.where(top_T >= 0, top_T // KEY_CHUNK + 1, 0)
    # blocks of whole tiles, each up to BLOCK_ITEMS items (a tile with more is a block of its own)
    ends = torch.cumsum(chunks_T, 0)
    block_T = torch.div(ends - chunks_T, BLOCK_ITEMS, rounding_mode="floor")
    K = seqs.kcol_NK.shape[1]
    blocks = []
    for blk in torch.unique(block_T).tolist():
        tiles = (block_T == blk).nonzero()[:, 0]
        c_T = chunks_T[tiles]
        tile_I = torch.repeat_interleave(torch.arange(len(tiles), device=dev), c_T)
        c_I = torch.arange(len(tile_I), device=dev) - (torch.cumsum(c_T, 0) - c_T)[tile_I]
        order = torch.argsort(c_I * len(tiles) + tile_I)  # chunk-major
        tile_I, c_I = tile_I[order], c_I[order]
        n = len(tile_I)
        counts = torch.bincount(c_I).tolist() if n else []
        bounds = [0, *torch.tensor(counts).cumsum(0).tolist()] if counts else [0]
        pad = -n % ATTN_ITEMS
        tile_I, c_I = F.pad(tile_I, (0, pad)), F.pad(c_I, (0, pad), value=-1)  # a padding item: chunk -1
        slot_IC = c_I[:, None] * KEY_CHUNK + torch.arange(KEY_CHUNK, device=dev)
        n_I = n_T[tiles][tile_I]
        kcol_IC = torch.where((slot_IC >= 0) & (slot_IC < K), seqs.kcol_NK[n_I[:, None], slot_IC.clamp(0, K - 1)], -1)
        kidx_IC = torch.where(kcol_IC >= 0, (kb_T[tiles][tile_I][:, None] * J + j_T[tiles][tile_I][:, None]) * S + kcol_IC, 0)
        hidden_IAC = (kcol_IC < 0)[:, None, :] | (slot_IC[:, None, :] > pos_TA[tiles][tile_I][:, :, None])
        calls = tuple(_Call(t.contiguous(), k.flatten(), h.contiguous()) for t, k, h in zip(
            tile_I.split(ATTN_ITEMS), kidx_IC.split(ATTN_ITEMS), hidden_IAC.split(ATTN_ITEMS)))
        blocks.append(_Block(rows_TA=rows_TA[tiles], calls=calls, chunks=tuple(zip(bounds, bounds[1:])),
                             tile_I=tile_I))
    return blocks


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: list[_Block], *,
            scaling: float) -> torch.Tensor:
    """query [B, H, W, D], key/value [B, J, S, D] -> [B, W, H, D] (in query's dtype), by the blocks' items."""
    B, H, W, D = query.shape
    q_RD = query.transpose(1, 2).reshape(B * W * H, D)
    k_RD, v_RD = key.reshape(-1, D), value.reshape(-1, D)
    out_RD = query.new_zeros(B * W * H, D)
    A, shape = ATTN_ROWS, (ATTN_ITEMS * KEY_CHUNK, D)
    # a call's keys or values, gathered in their dtype into one buffer and cast into another, both reused: a
    # fresh 1 MiB block a call is a fresh mapping (tidal/common/host_memory.py), zeroed page by page (6x the cast)
    gathered = key.new_empty(shape)
    f32 = gathered if key.dtype == torch.float32 else torch.empty(shape, device=key.device)

    def rows(x_RD: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        torch.index_select(x_RD, 0, idx, out=gathered)
        if f32 is not gathered:
            f32.copy_(gathered)
        return f32.view(ATTN_ITEMS, KEY_CHUNK, D)

    for blk in blocks:
        real_TA = blk.rows_TA >= 0
        q_TAD = q_RD.index_select(0, blk.rows_TA.clamp(min=0).flatten()).view(*real_TA.shape, D).float()
        q_TAD = q_TAD.masked_fill_(~real_TA[..., None], 0.0)
        m_TA = torch.full(real_TA.shape, float("-inf"), device=query.device)
        scores = []
        for call in blk.calls:
            s = torch.bmm(q_TAD.index_select(0, call.tile_I), rows(k_RD, call.kidx_X).transpose(1, 2)).mul_(scaling)
            s.masked_fill_(call.hidden_IAC, float("-inf"))
            m_TA.scatter_reduce_(0, call.tile_I[:, None].expand(-1, A), s.amax(-1), "amax")  # exact in any order
            scores.append(s)
        m_TA.masked_fill_(m_TA == float("-inf"), 0.0)
        pv_IAD = torch.empty(len(blk.tile_I), A, D, device=query.device)
        den_IA = torch.empty(len(blk.tile_I), A, device=query.device)
        for i, (call, s) in enumerate(zip(blk.calls, scores)):
            # exp of exactly what it weighs: a hidden slot's exp(-inf), or an underflow, takes a slow path
            p = s.sub_(m_TA.index_select(0, call.tile_I)[..., None]).masked_fill_(call.hidden_IAC, 0.0)
            p = p.exp_().masked_fill_(call.hidden_IAC, 0.0)
            items = slice(i * ATTN_ITEMS, (i + 1) * ATTN_ITEMS)
            torch.sum(p, -1, out=den_IA[items])
            torch.bmm(p, rows(v_RD, call.kidx_X), out=pv_IAD[items])
        acc_TAD = torch.zeros_like(q_TAD)
        tot_TA = torch.zeros(real_TA.shape, device=query.device)
        for start, end in blk.chunks:  # chunk 0's items, then chunk 1's, ...: a tile appears once in each
            acc_TAD.index_add_(0, blk.tile_I[start:end], pv_IAD[start:end])
            tot_TA.index_add_(0, blk.tile_I[start:end], den_IA[start:end])
        out_TAD = acc_TAD / tot_TA.masked_fill(tot_TA == 0, 1.0)[..., None]
        out_RD[blk.rows_TA[real_TA]] = out_TAD[real_TA].to(query.dtype)
    return out_RD.view(B, W, H, D)


class _ExactAttention(torch.autograd.Function):
    """The exact forward; the backward of `reference` (the default kernels on the same mask), recomputed."""

    @staticmethod
    def forward(ctx, query, key, value, blocks, scaling, reference):
        ctx.save_for_backward(query, key, value)
        ctx.reference = reference
        return _attend(query, key, value, blocks, scaling=scaling)

    @staticmethod
    def backward(ctx, grad_BWHD):
        saved = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip(saved, ctx.needs_input_grad[:3])]
            out = ctx.reference(*leaves)
        wanted = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad_BWHD))
        return (*(next(grads) if t.requires_grad else None for t in leaves), None, None, None)


def _padded_reference(keys: _Keys, *, scaling: float):
    """SDPA over the padded batch with the exact mask: a query column sees the real keys up to its position (a
    query that sees none, a padding column, sees all: its output is finite and nothing reads it)."""
    def reference(q_BHWD, k_BJSD, v_BJSD):
        B, H = q_BHWD.shape[:2]
        valid_BS, kpos_BS, qpos_BW = _padded_positions(keys, B, q_BHWD.device)
        mask_BWS = valid_BS[:, None, :] & (kpos_BS[:, None, :] <= qpos_BW[:, :, None])
        mask_BWS = mask_BWS | ~mask_BWS.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(q_BHWD.float(), k_BJSD.float(), v_BJSD.float(), attn_mask=mask_BWS[:, None],
                                             scale=scaling, enable_gqa=H != k_BJSD.shape[1])
        return out.transpose(1, 2).to(q_BHWD.dtype)
    return reference


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface: query [B, H, W, D], key/value [B, J, S, D] (the cache's whole length
    while decoding); returns [B, W, H, D]."""
    assert not dropout, "exact attention has no dropout"
    assert not kwargs.get("sliding_window"), "exact attention has no sliding window (refused at install)"
    B, H, W, D = query.shape
    J, S = key.shape[1], key.shape[2]
    scaling = scaling if scaling is not None else D ** -0.5
    dev = query.device
    if isinstance(attention_mask, PackMask):
        assert B == 1, "a packed row has batch size 1"
        cache, seqs_of = attention_mask._cache, lambda: _packed_seqs(attention_mask, dev)
        reference = lambda q, k, v: packed_attention(module, q, k, v, attention_mask, scaling=scaling)[0]  # noqa: E731
    else:
        keys = attention_mask if isinstance(attention_mask, _Keys) else _Keys(None, W, S)
        assert keys.q_length == W and keys.kv_length == S, "exact attention: mask and call disagree"
        cache, seqs_of = keys._cache, lambda: _padded_seqs(keys, B, dev)
        reference = _padded_reference(keys, scaling=scaling)
    key_ = ("exact-plan", str(dev), H, J)
    if key_ not in cache:
        cache[key_] = _plan(seqs_of(), H=H, J=J, W=W, S=S)
    blocks = cache[key_]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return _ExactAttention.apply(query, key, value, blocks, scaling, reference), None
    return _attend(query, key, value, blocks, scaling=scaling), None


AttentionInterface.register(ATTN_NAME, _attention)
AttentionMaskInterface.register(ATTN_NAME, _mask)
