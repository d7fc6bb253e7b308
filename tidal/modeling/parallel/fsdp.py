"""FSDP2: `fully_shard` each decoder layer, then the root (embedding, final norm, lm_head).

Per-layer units bound the all-gathered memory to about one layer at a time. Gradients are summed
over dp, not averaged: the trainer divides once at the barrier by the global denominator
(docs/architecture.md "Determinism"), so FSDP must not divide again.

Forward-only copies (old policy, reference): by default the root unit does not reshard after its
forward (FSDP2 expects the backward to follow and reuse the gathered weights). Without a backward,
its embedding, final norm and lm_head stay unsharded: the module then exposes full tensors where
the sharded parameters were, and a later copy into it (the next old-policy snapshot) lands in
buffers the next all-gather overwrites, or fails on shapes. `forward_only=True` makes the root
reshard after every forward like the layers do (tests/test_parallel.py shows both).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers; FSDP wraps HF decoder models only")
    return list(layers)


def apply_fsdp(model: nn.Module, *, mesh: DeviceMesh, forward_only: bool = False,
               param_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard `model` in place over the 1-D dp `mesh` (after tp, if any).

    param_dtype: mixed precision. The sharded parameters stay as loaded (the fp32 master weights the
    optimizer steps); FSDP gathers them cast to `param_dtype`, the forward and backward compute in
    it, and gradients are cast to fp32 before they are reduced over dp."""
    # cast_forward_inputs off: a layer's floating inputs come from bf16 layers already, and the cast
    # would rebuild every dataclass argument (a packed row's PackMask carries a non-init cache)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None,
                              cast_forward_inputs=False)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
    # None: FSDP2's default for a root, keep the gathered weights for the backward that follows
    fully_shard(model, mesh=mesh, reshard_after_forward=True if forward_only else None, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # plain SUM collectives: gloo has neither AVG nor PREMUL_SUM, and factor 1 needs no scaling
            module.set_force_sum_reduction_for_comms(True)
    return model
