"""A GEMM that rounds by the shape of its call: the test double of a library that picks its kernel, its blocking
and its split of the reduction by the whole shape (oneDNN with AMX, cuBLAS), on any machine.

Under `ShapeKeyedGemm()` every mm/addmm/bmm/baddbmm sums its reduction dimension in blocks whose size is a
function of the call's shapes: each block's partial product exactly (float64, then float32), the partials added
in float32 one after another. Two calls of one shape give a row the same bits; calls of different shapes
mostly do not, whatever this machine's own GEMM does. Exact numerics must hold under it
(tests/test_numerics.py); the default kernels do not.
"""
from __future__ import annotations

import zlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
BLOCKS = (8, 16, 24, 40, 56)  # reduction block sizes; a call's shape picks one


def _block(key) -> int:
    return BLOCKS[zlib.crc32(repr(key).encode()) % len(BLOCKS)]


def _product(a: torch.Tensor, b: torch.Tensor, key) -> torch.Tensor:
    """a @ b in float32 (batched or not), its reduction in blocks chosen by `key`."""
    K, kb = a.shape[-1], _block(key)
    acc = None
    for k in range(0, K, kb):
        part = (a[..., k:k + kb].double() @ b[..., k:k + kb, :].double()).float()
        acc = part if acc is None else acc + part
    return acc if acc is not None else torch.zeros(*a.shape[:-1], b.shape[-1])


class ShapeKeyedGemm(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        out = kwargs.pop("out", None)
        packet = func.overloadpacket
        if packet in (aten.mm, aten.bmm):
            a, b = args
            res = _product(a, b, (packet.__name__, tuple(a.shape), tuple(b.shape), a.dtype))
        elif packet in (aten.addmm, aten.baddbmm):
            bias, a, b = args[:3]
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            res = _product(a, b, (packet.__name__, tuple(a.shape), tuple(b.shape), a.dtype)) * alpha
            res = res + beta * bias.float() if beta else res
        else:
            return func(*args, **({"out": out} if out is not None else {}), **kwargs)
        res = res.to(args[-1].dtype)
        if out is not None:
            return out.copy_(res)
        return res
