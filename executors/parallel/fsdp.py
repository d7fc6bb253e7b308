"""FSDP2: `fully_shard` each decoder layer, then the root (embedding, final norm, lm_head).

Per-layer units bound the all-gathered memory to about one layer at a time. Gradients are summed
over dp, not averaged: the trainer divides once at the barrier by the global denominator
(DESIGN.md "Normalisation that survives streaming"), so FSDP must not divide again.

Forward-only copies (old policy, reference): by default the root unit does not reshard after its
forward (FSDP2 expects the backward to follow and reuse the gathered weights). Without a backward,
its embedding, final norm and lm_head stay unsharded: the module then exposes full tensors where
the sharded parameters were, and a later copy into it (the next old-policy snapshot) lands in
buffers the next all-gather overwrites, or fails on shapes. `forward_only=True` makes the root
reshard after every forward like the layers do (tests/test_parallel.py shows both).
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers; FSDP wraps HF decoder models only")
    return list(layers)


def apply_fsdp(model: nn.Module, *, mesh: DeviceMesh, forward_only: bool = False) -> nn.Module:
    """Shard `model` in place over the 1-D dp `mesh` (after tp, if any)."""
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    # None: FSDP2's default for a root, keep the gathered weights for the backward that follows
    fully_shard(model, mesh=mesh, reshard_after_forward=True if forward_only else None)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # plain SUM collectives: gloo has neither AVG nor PREMUL_SUM, and factor 1 needs no scaling
            module.set_force_sum_reduction_for_comms(True)
    return model
