"""Exact numerics (`model.numerics=exact`): a token's log-prob has the same bits whatever else is in the batch.

Why the default kernels disagree. The engine decodes a token as one row among the batch's rows, over a KV
cache; the trainer scores it inside a packed row of thousands of tokens. Same model, same weights, but a CPU
or GPU GEMM picks its kernel, its blocking and how it splits a reduction by the whole shape of the call (MKL
here, fp32: a 1- to 3-row product rounds differently from a 16-row one; oneDNN with AMX on a Xeon: the head's
bf16 product from 48 rows on, its fp32 one from 128), and SDPA sums a query's keys in an order set by how many
keys the call holds. bf16 then carries each difference into the next layer: the engine's and the trainer's
log-probs ended up 0.02 apart (mean, SmolLM2-135M), 0.15 at most on Qwen2.5-0.5B on that Xeon.

The rule, by construction rather than by measurement: **every library call whose rows come from different
batches has one fixed shape**, whatever the batch. A call's result for one output element is a function of
the call's shape, strides, alignment, dtype and thread count and of that element's own operands: the library
has nothing else to pick its kernel by. Fix the shape, and a row meets its weights in the same arithmetic
alone, among 7 prompts, or in the trainer's packed row of 4,000 tokens, on any machine and any library
(no kernel, ISA or threshold of this machine is assumed). So:
  linear     the rows go in tiles of ROW_TILE: `mm([ROW_TILE, K], [K, N])` a tile at a time, the last tile
             padded with zero rows, every tile contiguous and 64-byte aligned (MKL's documented condition for
             alignment-independent results); K and N are the layer's own. This covers the projections, the MLP,
             the LM head (whole vocabulary per call: its shape is the model's on both sides; a bf16 head's
             product in float32, tidal/modeling/head.py), LoRA's adapters and a mixture of experts' routers and
             experts (their F.linear on 3-D weights runs under a torch function mode).
  attention  items of a fixed shape in calls of a fixed count: tidal/modeling/exact_attention.py argues it.
The thread count is part of the shape: every rank of a node runs the same (tidal/controller/devices.py pins it).
Norms, RoPE, activations and residual adds work per element or reduce over one row's hidden size, and
log_softmax over one row's vocabulary, whose kernels walk a row the same way in any batch (tests/test_numerics.py
checks each module at the published widths, rows 1 to 4,096, under each oneDNN ISA this machine can select, and
a test double GEMM that picks its summation order by the call's shape shows the rule is what holds it).

The backward needs no invariance (only the forward's log-probs must match the sampler's): a linear's gradients
are the usual two GEMMs over all rows at once, and attention's those of the default kernels.

Cost: a tile of 16 rows is what an engine's 8-64 rows want; the trainer's forward pays its many small calls
(bench/exact.py: the whole job's s/step against the default's). Not covered (refused in one line,
tidal/recipes/checks.py): tensor and expert parallel (an all-reduce's order), the megatron backend and vLLM (their
own kernels), sliding-window layers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tidal.modeling.exact_attention import ATTN_NAME

ROW_TILE = 16  # rows of every linear layer's GEMM call (bench/exact.py: 16 against 32 and 64, the whole job)
ALIGN = 64  # bytes: every tile of a call starts on a cache line
COLUMNS_ABOVE = 16 << 20  # a weight larger than this goes in column blocks (the LM heads)
COLUMN_BYTES = 2 << 20  # a column block's weight: what a core's cache keeps while the row tiles pass


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN == 0


def _tiles(x_MK: torch.Tensor) -> torch.Tensor:
    """x's rows padded with zero rows to a multiple of ROW_TILE, contiguous, every tile 64-byte aligned: x itself
    where it is so already."""
    M, K = x_MK.shape
    pad = -M % ROW_TILE
    if pad or not x_MK.is_contiguous() or not _aligned(x_MK):
        x_MK = torch.cat([x_MK, x_MK.new_zeros(pad, K)]) if pad else x_MK.contiguous().clone()
    return x_MK


def _columns(N: int, K: int, element: int) -> int:
    """Output columns of one call. A weight over COLUMNS_ABOVE bytes (an LM head: 113 MB in float32 for SmolLM2,
    545 MB for Qwen2.5) goes in blocks of at most COLUMN_BYTES (a power of two of columns, at least 256), so a
    block stays in cache while the row tiles pass it: streamed whole from memory once per 16-row tile, the head
    took 2.0-2.3x one call's time at 128-1,024 rows, in blocks of 512 columns 0.8-1.1x (bench/exact_kernels.py).
    A function of the layer's shape alone: the engine and the trainer cut a layer the same way."""
    if N * K * element <= COLUMNS_ABOVE:
        return N
    n = max(COLUMN_BYTES // (K * element), 256)
    return min(N, 1 << (n.bit_length() - 1))


def _tiled(x_MK: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None) -> torch.Tensor:
    """F.linear as calls of one shape: [ROW_TILE, K] x [K, columns] (+ bias), a column block at a time and within
    it a tile of rows at a time."""
    M, N = x_MK.shape[0], w_NK.shape[0]
    if not (w_NK.is_contiguous() and _aligned(w_NK)):
        w_NK = w_NK.contiguous().clone()
    x_MK = _tiles(x_MK)
    K = x_MK.shape[1]
    y_MN = x_MK.new_empty(x_MK.shape[0], N, dtype=torch.result_type(x_MK, w_NK))
    if (ROW_TILE * K * x_MK.element_size()) % ALIGN:  # a tile of x would start off a cache line: copy each
        tiles = [x_MK[s:s + ROW_TILE].clone() for s in range(0, x_MK.shape[0], ROW_TILE)]
    else:
        tiles = list(x_MK.split(ROW_TILE))
    n = _columns(N, K, w_NK.element_size())
    for c in range(0, N, n):
        w_KC = w_NK[c:c + n].t()
        b_C = None if b_N is None else b_N[c:c + n]
        outs = (y_MN if n == N else y_MN[:, c:c + n]).split(ROW_TILE)
        if b_C is None:
            for x_TK, out in zip(tiles, outs):
                torch.mm(x_TK, w_KC, out=out)
        else:
            for x_TK, out in zip(tiles, outs):
                torch.addmm(b_C, x_TK, w_KC, out=out)
    return y_MN[:M]


class _TiledLinear(torch.autograd.Function):
    """The tiled forward; the usual backward (two GEMMs over all rows: gradients need no invariance)."""

    @staticmethod
    def forward(ctx, x_MK, w_NK, b_N):
        ctx.save_for_backward(x_MK, w_NK)
        ctx.has_bias = b_N is not None
        return _tiled(x_MK, w_NK, b_N)

    @staticmethod
    def backward(ctx, g_MN):
        x_MK, w_NK = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        return (g_MN.mm(w_NK) if need_x else None, g_MN.t().mm(x_MK) if need_w else None,
                g_MN.sum(0) if ctx.has_bias and need_b else None)


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose every library call has one shape: a row's output does not depend on the rows with it."""
    x_MK = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        y_MN = _TiledLinear.apply(x_MK, weight, bias)
    else:
        y_MN = _tiled(x_MK, weight, bias)
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
    name, which tidal/modeling/moe.py finds routers and experts by)."""
    if cls not in _EXACT_CLASSES:
        def forward(self, *args, **kwargs):
            with _LinearMode():
                return cls.forward(self, *args, **kwargs)

        _EXACT_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "__qualname__": f"exact.{cls.__name__}"})
    return _EXACT_CLASSES[cls]


def linear_for(head: nn.Module):
    """The product a head's float32 logits take (tidal/modeling/head.py)."""
    return exact_linear if isinstance(head, ExactLinear) else F.linear


def check_model(config) -> None:
    """What of a model exact mode cannot run, as a ValueError (tidal/recipes/checks.py asks before any rank starts)."""
    types = getattr(config, "layer_types", None)
    # a config without layer_types (Mistral) slides every layer when it names a window
    if "sliding_attention" in (types or []) or (types is None and getattr(config, "sliding_window", None)):
        raise ValueError(f"model.numerics=exact with sliding-window attention layers ({config.model_type}): not "
                         f"supported yet; use model.numerics=default")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError(f"model.numerics=exact with attention logit soft-capping ({config.model_type}): not "
                         f"supported yet; use model.numerics=default")


def install(model: nn.Module) -> None:
    """Exact numerics on `model`, in place (idempotent): its Linear layers and its attention. Copies made
    afterwards (the old policy, the reference) inherit both."""
    config = model.config
    check_model(config)
    from tidal.modeling.moe import FAMILIES

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
