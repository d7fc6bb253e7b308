"""Attention over the native engine's slot cache: a KV store allocated once per generate call, written in place.

The engine (tidal/executors/generator/slots.py) gives every sample a *slot*: row n of a store that holds, per layer, K and
V as [N, J, S + 1, D], the key of position p in column p. A forward feeds W new columns to some slots
(`SlotForward`: batch row b is slot rows_B[b], its columns at positions pos_BW[b], -1 for padding); each layer
writes its new keys and values into their columns (padding, and a position past S, into column S, which no query
reads) and attends over its slot's columns up to each query's position. Why that is the whole rule:
  * a slot is written from position 0 on, one position after the other (a prompt, then a token or an observation
    at a time), so the columns below a query's position are exactly its sequence's keys: causality by position
    is the mask, and a column left by the slot's previous sample sits at a position its queries have not reached;
  * nothing grows: a token's keys go into their column (`index_put_`), and a finished sample's slot goes to the
    next prompt as it is (the store is zeroed once, so a column no query needs holds finite values, which a
    weight of exactly 0 removes).
Default numerics: SDPA over the store's first `width` columns (the forward's largest position + 1), in float32 for a
low-precision model on CPU (tidal/modeling/packed_attention.py says why). Exact numerics: exact attention's items
(tidal/modeling/exact_attention.py) with the store's columns as key slots, so a token meets its keys in the same items
in a decode step, a prefill and the trainer's packed row.

Hook: the engine's model runs under ATTN_NAME; transformers asks our mask function for each forward's mask, and it
hands every layer the SlotForward the engine set around the call (`slot_forward`).
"""
from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from tidal.modeling.exact_attention import _attend, _plan, _Seqs
from tidal.modeling.packed_attention import scoped

ATTN_NAME = "tidal_slots"


class SlotStore:
    """Every layer's keys and values, [N slots, J key heads, S + 1 positions, D], made at the layer's first write
    (its heads and dtype are the key's: a tp shard's own) and zeroed once."""

    def __init__(self, *, slots: int, length: int, exact: bool):
        self.N, self.S, self.exact = slots, length, exact
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, index: int, key_BJWD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if index not in self.kv:
            shape = (self.N, key_BJWD.shape[1], self.S + 1, key_BJWD.shape[3])
            self.kv[index] = (key_BJWD.new_zeros(shape), key_BJWD.new_zeros(shape))
        return self.kv[index]

    def share(self, src_C: torch.Tensor, dst_C: torch.Tensor, *, columns: int) -> None:
        """Slot dst_C[c] takes the first `columns` positions of slot src_C[c] (a prompt's G samples share its prefill)."""
        for k, v in self.kv.values():
            k[dst_C, :, :columns] = k[src_C, :, :columns]
            v[dst_C, :, :columns] = v[src_C, :, :columns]


@dataclass(eq=False)
class SlotForward:
    store: SlotStore
    rows_B: torch.Tensor  # the slot of each batch row (device)
    pos_BW: torch.Tensor  # the position of each new column (device); -1: padding
    width: int  # columns the queries reach: their largest position + 1
    span: tuple[int, int] | None = None  # rows_B is this range of slots: attention reads the store in place
    _cache: dict = field(default_factory=dict, repr=False)  # built by the first layer, used by the rest


_ACTIVE: ContextVar[SlotForward | None] = ContextVar("tidal_slot_forward", default=None)


def slot_forward(fwd: SlotForward):
    """Within this block, the model's forward attends over `fwd`'s slots."""
    return scoped(_ACTIVE, fwd)


def _mask(*args, **kwargs):
    fwd = _ACTIVE.get()
    assert fwd is not None, "a model under slot attention runs inside slot_forward (the native engine's)"
    return fwd


def _write(fwd: SlotForward, K: torch.Tensor, V: torch.Tensor, key_BJWD: torch.Tensor, value_BJWD: torch.Tensor):
    S = fwd.store.S
    if "write" not in fwd._cache:
        B, J, W, _ = key_BJWD.shape
        p_BW = torch.where((fwd.pos_BW >= 0) & (fwd.pos_BW < S), fwd.pos_BW, S)
        fwd._cache["write"] = (fwd.rows_B[:, None, None].expand(B, J, W), torch.arange(J, device=K.device)[None, :, None],
                               p_BW[:, None, :])
    index = fwd._cache["write"]
    K.index_put_(index, key_BJWD)
    V.index_put_(index, value_BJWD)


def _visible(fwd: SlotForward, window: int | None, device) -> torch.Tensor:
    """[B, 1, W, width] bool: a query sees the keys at its position and below (within a sliding window: less than
    `window` below); a padding query sees column 0, so its output stays finite (nothing reads it)."""
    key = ("visible", window)
    if key not in fwd._cache:
        q_BW1 = fwd.pos_BW[:, :, None]
        k_S = torch.arange(fwd.width, device=device)
        seen = k_S <= q_BW1
        if window is not None:
            seen &= q_BW1 - k_S < window
        fwd._cache[key] = (seen | ((q_BW1 < 0) & (k_S == 0)))[:, None]
    return fwd._cache[key]


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query [B, H, W, D], key/value [B, J, W, D]: the W new columns. Returns [B, W, H, D]."""
    fwd = attention_mask
    assert isinstance(fwd, SlotForward) and not dropout
    B, H, W, D = query.shape
    K, V = fwd.store.layer(module.layer_idx, key)
    _write(fwd, K, V, key, value)
    scaling = scaling if scaling is not None else D ** -0.5
    window = kwargs.get("sliding_window")
    if fwd.store.exact:
        assert not window, "exact attention has no sliding window (refused at install)"
        plan = ("exact-plan", H, K.shape[1])
        if plan not in fwd._cache:
            width = fwd.width
            seqs = _Seqs(torch.arange(B, device=query.device), torch.arange(W, device=query.device).expand(B, W),
                         fwd.pos_BW, torch.arange(width, device=query.device).expand(B, width), kb_N=fwd.rows_B)
            fwd._cache[plan] = _plan(seqs, H=H, J=K.shape[1], W=W, S=K.shape[2])
        return _attend(query, K, V, fwd._cache[plan], scaling=scaling), None
    if fwd.span is not None:
        k, v = K[fwd.span[0]:fwd.span[1], :, :fwd.width], V[fwd.span[0]:fwd.span[1], :, :fwd.width]
    else:
        k, v = K[:, :, :fwd.width].index_select(0, fwd.rows_B), V[:, :, :fwd.width].index_select(0, fwd.rows_B)
    q = query
    if q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu":
        q, k, v = q.float(), k.float(), v.float()  # the packed attention's rule, for the same reason
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=_visible(fwd, window, q.device), scale=scaling,
                                         enable_gqa=H != k.shape[1])
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


AttentionInterface.register(ATTN_NAME, _attention)
AttentionMaskInterface.register(ATTN_NAME, _mask)
