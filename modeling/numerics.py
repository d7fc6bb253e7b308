"""Exact numerics (`model.numerics=exact`): a token's log-prob has the same bits whatever else is in the batch.

Why the default kernels disagree. The engine decodes a token as one row among the batch's rows, over a KV
cache; the trainer scores it inside a packed row of thousands of tokens. Same model, same weights, but a
CPU GEMM picks its code path by the number of rows (measured with MKL here, fp32: a 1- to 3-row product
rounds differently from a 16-row one, and 5 rows on 2 threads differently again), and SDPA sums a query's
keys in an order set by how many keys the call holds and where padding sits. bf16 rounds each of those
differences into the next layer, which is how the engine's and the trainer's log-probs ended up 0.02
apart (mean, SmolLM2-135M).

What exact mode does instead, in plain torch (so CPU in CI, CUDA and NPU run the same code):
  linear     the rows go to the GEMM padded with zero rows to a multiple of ROW_TILE. Every row count is
             then in the regime where the GEMM's reduction over K is the same for each row: measured here
             for 1..300 rows, every shape of the three models, fp32 and bf16, 1 and 2 threads
             (tests/test_numerics.py checks it on the machine it runs on).
  attention  one fixed split of the keys by logical position: a query's keys are gathered into slots
             0..pos (a shared prompt's keys first, then the response's own), in chunks of KEY_CHUNK; a key
             head's query rows (padded to ROW_TILE) meet each chunk in GEMMs whose reductions have fixed
             lengths (D for the scores, KEY_CHUNK for the values), and the chunks are added one after another
             in slot order. Slots past a query's position weigh exactly 0, so a decode step over a cache of
             300 columns and the trainer's packed row of 2,000 give a query the same sums. Scores, softmax
             and both products in float32, as the default CPU path.
  head       the LM head is a linear like the others (a bf16 head's product in float32, modeling/head.py);
             log_softmax works per row.
Norms, RoPE, activations and residual adds work per row (elementwise or reduced over the hidden size of
one row) and are batch-invariant as they are; the per-op test checks that too.

Cost: a decode step's attention GEMMs carry its query rows padded to ROW_TILE (16 rows for SmolLM2's 3 query
heads per key head), and the gathers copy the keys per layer; bench/exact.py measures it. A mixture-of-experts
model's router and experts call F.linear on their own 3-D weights: they run under a torch function mode that
pads those products too, with transformers' eager experts (one product per expert, added to each token in
expert order); the routing then agrees without replay. Not covered (refused in one line, recipes/checks.py):
tensor and expert parallel (an all-reduce's order), the megatron backend and vLLM (their own kernels),
sliding-window layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from modeling.packed_attention import PackMask, active_pack

ATTN_NAME = "tidal_exact"
ROW_TILE = 16  # a GEMM's rows come in multiples of this (measured batch-invariant from here up)
KEY_CHUNK = 64  # keys per attention chunk: the fixed reduction length of every score and value product


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with the rows padded to a multiple of ROW_TILE: a row's output does not depend on how many
    rows came with it."""
    x_MK = x.reshape(-1, x.shape[-1])
    pad = -x_MK.shape[0] % ROW_TILE
    if pad:
        x_MK = torch.cat([x_MK, x_MK.new_zeros(pad, x_MK.shape[1])])
    y_MN = F.linear(x_MK, weight, bias)
    if pad:
        y_MN = y_MN[:-pad]
    return y_MN.reshape(*x.shape[:-1], y_MN.shape[-1])


class ExactLinear(nn.Linear):
    """nn.Linear through `exact_linear` (install swaps the class of a model's Linear modules in place, so
    FSDP2, LoRA's wrappers and activation checkpointing's replays all run it)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return exact_linear(input, self.weight, self.bias)


class _LinearMode(TorchFunctionMode):
    """F.linear called inside a module's own forward (a mixture-of-experts router's and experts' 3-D weights,
    which are no nn.Linear) goes through `exact_linear`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return exact_linear(*args, **kwargs)
        return func(*args, **kwargs)


_EXACT_CLASSES: dict[type, type] = {}


def _exact_class(cls: type) -> type:
    """`cls` whose forward runs under _LinearMode (a subclass, so copies of the module keep it; the same
    name, which modeling/moe.py finds routers and experts by)."""
    if cls not in _EXACT_CLASSES:
        def forward(self, *args, **kwargs):
            with _LinearMode():
                return cls.forward(self, *args, **kwargs)

        _EXACT_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "__qualname__": f"exact.{cls.__name__}"})
    return _EXACT_CLASSES[cls]


def linear_for(head: nn.Module):
    """The product a head's float32 logits take (modeling/head.py)."""
    return exact_linear if isinstance(head, ExactLinear) else F.linear


def check_model(config) -> None:
    """What of a model exact mode cannot run, as a ValueError (recipes/checks.py asks before any rank starts)."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError(f"model.numerics=exact with sliding-window attention layers ({config.model_type}): not "
                         f"supported yet; use model.numerics=default")


def install(model: nn.Module) -> None:
    """Exact numerics on `model`, in place (idempotent): its Linear layers and its attention. Copies made
    afterwards (the old policy, the reference) inherit both."""
    config = model.config
    check_model(config)
    from modeling.moe import FAMILIES

    family = FAMILIES.get(config.model_type) if config.model_type in FAMILIES else None
    own_linear = {family.router, family.experts} if family is not None else set()
    if family is not None and getattr(config, "_experts_implementation", "eager") != "eager":
        # the eager experts: one F.linear per expert over its tokens (padded here), added to each token in
        # expert order; grouped_mm's kernel is not row-invariant (measured: 1e-6 in fp32)
        model.set_experts_implementation("eager")
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = ExactLinear
        elif type(module).__name__ in own_linear and type(module) not in _EXACT_CLASSES.values():
            module.__class__ = _exact_class(type(module))
    if torch.cuda.is_available():
        # what peers found cuBLAS needs besides fixed shapes (not run here: no GPU has run exact mode yet):
        # no TF32, and no reduced-precision partial sums in bf16/fp16 products (split-K reductions)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    if config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)


def is_exact(model: nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == ATTN_NAME


# ---- attention ---------------------------------------------------------------------------------------

@dataclass(eq=False)
class _Keys:
    """A padded batch's layout (the engine's prefill and decode, the trainer's padded rows): which key
    columns are real (`valid_BS`, None: all) and how many of the last columns are queries."""
    valid_BS: torch.Tensor | None
    q_length: int
    kv_length: int
    _cache: dict = field(default_factory=dict, repr=False)


def _mask(*args, **kwargs):
    """What every layer of a forward gets as its `attention_mask`: a packed row's PackMask, or the padded
    batch's _Keys (built once per forward by transformers, so the index work below is done once)."""
    pack = active_pack()
    if pack is not None:
        return pack
    mask = kwargs.get("attention_mask")
    if mask is not None:
        assert mask.dim() == 2, "exact attention takes a 2-D padding mask"
        mask = mask.bool()
    return _Keys(mask, kwargs["q_length"], kwargs["kv_length"])


def _ceil(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)


@dataclass(frozen=True)
class _Layout:
    """Sequences of queries and their keys, built once per forward and shared by its layers. q_idx/k_idx index
    the flattened [rows x columns] of the call (-1: an empty slot); key slot j holds the key of logical
    position j; `allowed` [N, 1, C, Q, chunk]: which slots each query sees (by its logical position)."""
    q_idx_NQ: torch.Tensor
    k_idx_NK: torch.Tensor
    allowed: torch.Tensor

    @classmethod
    def of(cls, q_idx_NQ, qpos_NQ, k_idx_NK, kval_NK) -> "_Layout":
        N, Q = qpos_NQ.shape
        K = k_idx_NK.shape[1]
        slot_K = torch.arange(K, device=qpos_NQ.device)
        allowed_NQK = (slot_K <= qpos_NQ[..., None]) & kval_NK[:, None, :]
        allowed = allowed_NQK.view(N, 1, Q, K // KEY_CHUNK, KEY_CHUNK).transpose(2, 3).contiguous()
        # an empty slot reads column 0 of the call (a finite value that softmax weighs 0), not a copy with zeros
        return cls(q_idx_NQ, k_idx_NK.clamp(min=0), allowed)


def _padded_layout(keys: _Keys, B: int, device) -> list[_Layout]:
    key = ("layout", str(device))
    if key in keys._cache:
        return keys._cache[key]
    S, W = keys.kv_length, keys.q_length
    valid_BS = keys.valid_BS[:, -S:].to(device) if keys.valid_BS is not None else \
        torch.ones(B, S, dtype=torch.bool, device=device)
    kpos_BS = valid_BS.long().cumsum(1) - 1
    n_B = valid_BS.sum(1)
    K = _ceil(int(n_B.max()), KEY_CHUNK)
    cols_BS = torch.arange(S, device=device) + S * torch.arange(B, device=device)[:, None]
    k_idx = torch.full((B, K + 1), -1, dtype=torch.long, device=device)
    k_idx.scatter_(1, torch.where(valid_BS, kpos_BS, K), cols_BS)
    q_idx = torch.arange(W, device=device) + W * torch.arange(B, device=device)[:, None]
    qpos = torch.where(valid_BS[:, S - W:], kpos_BS[:, S - W:], -1)
    layouts = [_Layout.of(q_idx, qpos, k_idx[:, :K], torch.arange(K, device=device) < n_B[:, None])]
    keys._cache[key] = layouts
    return layouts


def _packed_layout(pack: PackMask, device) -> list[_Layout]:
    """A packed row's segments as sequences: a varlen segment attends its own tokens; with a shared prompt
    a response attends the prompt's tokens, then its own (logical positions P, P+1, ...). Sequences of one
    padded size go together (a long prompt does not pad every response to its length)."""
    key = ("exact-layout", str(device))
    if key in pack._cache:
        return pack._cache[key]
    P = pack.spans[0][1] if pack.shared else 0
    buckets: dict[tuple[int, int], list] = {}  # (queries, key slots) padded -> its sequences
    for s, (a, e) in enumerate(pack.spans):
        own = list(range(a, e))
        seq = (own, list(range(P, P + e - a)), list(range(P)) + own) if pack.shared and s > 0 else \
            (own, list(range(e - a)), own)
        buckets.setdefault((_ceil(len(own), ROW_TILE), _ceil(len(seq[2]), KEY_CHUNK)), []).append(seq)

    def rows(lists, width):
        return torch.tensor([x + [-1] * (width - len(x)) for x in lists], dtype=torch.long, device=device)

    layouts = []
    for seqs in buckets.values():
        Q, K = max(len(q) for q, _, _ in seqs), _ceil(max(len(k) for _, _, k in seqs), KEY_CHUNK)
        k_idx = rows([k for _, _, k in seqs], K)
        layouts.append(_Layout.of(rows([q for q, _, _ in seqs], Q), rows([p for _, p, _ in seqs], Q), k_idx, k_idx >= 0))
    pack._cache[key] = layouts
    return layouts


def _gather(x_BHSD: torch.Tensor, idx_NI: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] at flattened (row, column) indices [N, I] (all >= 0) -> [N, H, I, D], float32: one copy of
    what is taken (a decode step's keys are most of its cache), cast after."""
    S = x_BHSD.shape[2]
    # advanced indices on dims 0 and 2 around a slice: the result is [N, I, H, D]
    return x_BHSD[torch.div(idx_NI, S, rounding_mode="floor"), :, idx_NI % S].transpose(1, 2).float()


def _pad_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x with zero rows appended along `dim` up to a multiple of ROW_TILE (a GEMM's M)."""
    pad = -x.shape[dim] % ROW_TILE
    if not pad:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def exact_attention(q_NHQD: torch.Tensor, k_NJKD: torch.Tensor, v_NJKD: torch.Tensor, allowed: torch.Tensor, *,
                    scaling: float) -> torch.Tensor:
    """Softmax attention of each sequence's queries (H heads) over its key slots (J key heads, H = J x g), in
    float32: [N, H, Q, D]. K is a multiple of KEY_CHUNK; `allowed` [N, 1, C, Q, chunk]; a query that sees no
    slot gets zeros.

    A key head's g x Q query rows (padded to a multiple of ROW_TILE) meet each chunk of keys in one GEMM over
    D, and their weights meet the chunk's values in one GEMM over the chunk: fixed reduction lengths, and a
    row's result does not depend on the other rows. The chunks are added one after another in slot order."""
    N, H, Q, D = q_NHQD.shape
    J, K = k_NJKD.shape[1], k_NJKD.shape[2]
    g, C = H // J, K // KEY_CHUNK
    k5 = k_NJKD.reshape(N, J, C, KEY_CHUNK, D)
    v5 = v_NJKD.reshape(N, J, C, KEY_CHUNK, D)
    rows = _pad_rows(q_NHQD.reshape(N, J, 1, g * Q, D), dim=3)
    s = (rows @ k5.transpose(-1, -2))[:, :, :, :g * Q] * scaling  # [N, J, C, gQ, chunk]
    s = s.view(N, J, C, g, Q, KEY_CHUNK).masked_fill(~allowed[:, :, :, None], float("-inf"))
    m = s.detach().amax(dim=(2, 5), keepdim=True)  # exact in any order; softmax does not depend on it
    m = m.masked_fill(~torch.isfinite(m), 0.0)
    p = torch.exp(s - m)  # [N, J, C, g, Q, chunk]
    den = p.sum(-1)
    pv = (_pad_rows(p.view(N, J, C, g * Q, KEY_CHUNK), dim=3) @ v5)[:, :, :, :g * Q].view(N, J, C, g, Q, D)
    acc, tot = pv[:, :, 0], den[:, :, 0]
    for c in range(1, C):  # one chunk after another, in slot order: trailing all-zero chunks add nothing
        acc, tot = acc + pv[:, :, c], tot + den[:, :, c]
    out = acc / tot.masked_fill(tot == 0, 1.0)[..., None]  # [N, J, g, Q, D]
    return out.reshape(N, H, Q, D)


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface: query [B, H, W, D], key/value [B, Hkv, S, D] (the cache's whole
    length while decoding); returns [B, W, H, D]."""
    assert not dropout, "exact attention has no dropout"
    assert not kwargs.get("sliding_window"), "exact attention has no sliding window (refused at install)"
    B, H, W, D = query.shape
    dev = query.device
    if isinstance(attention_mask, PackMask):
        assert B == 1, "a packed row has batch size 1"
        layouts = _packed_layout(attention_mask, dev)
    else:
        keys = attention_mask if isinstance(attention_mask, _Keys) else _Keys(None, W, key.shape[2])
        assert keys.q_length == W and keys.kv_length == key.shape[2], "exact attention: mask and call disagree"
        layouts = _padded_layout(keys, B, dev)
    scaling = scaling if scaling is not None else D ** -0.5
    out = query.new_zeros(B * W, H, D)
    for layout in layouts:
        q = _gather(query, layout.q_idx_NQ.clamp(min=0))  # an empty query slot computes a row nobody reads
        k, v = _gather(key, layout.k_idx_NK), _gather(value, layout.k_idx_NK)
        out_NHQD = exact_attention(q, k, v, layout.allowed, scaling=scaling).to(query.dtype)
        real = layout.q_idx_NQ >= 0  # back to [B, W, H, D]: every query column appears once among them
        out = out.index_copy(0, layout.q_idx_NQ[real], out_NHQD.transpose(1, 2)[real])
    return out.view(B, W, H, D), None


AttentionInterface.register(ATTN_NAME, _attention)
AttentionMaskInterface.register(ATTN_NAME, _mask)
