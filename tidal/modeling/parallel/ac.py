"""Activation checkpointing per decoder layer: a layer keeps only its inputs for the backward and
runs its forward again there (torch.utils.checkpoint, non-reentrant).

Memory: the activations of one layer at a time instead of all of them, for one more forward of each
layer (~1/3 more compute in a training step). The layer's own `forward` is wrapped, inside its
`__call__`, so FSDP2's and tensor parallel's hooks stay outside the recomputed part (the order
torchtitan uses) and parameter names do not change (the weight push and checkpoints see the same
model). Packed rows replay exactly: their attention mask is an argument of each layer
(packed_attention.py), not a context that has ended by the backward.
"""
from __future__ import annotations

import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tidal.modeling.parallel.fsdp import decoder_layers


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    forward = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():  # old policy, reference, evaluation: nothing to save
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_ac(model: nn.Module, *, layers=None) -> nn.Module:
    """Checkpoint every decoder layer of `model` (an HF model's, or `layers`: megatron's
    model.decoder.layers), in place (idempotent). A bound method, so a deep copy of the model (the
    old policy) runs its own layers, not these."""
    for layer in decoder_layers(model) if layers is None else layers:
        layer.forward = types.MethodType(_checkpointed_forward, layer)
    return model


def has_ac(model: nn.Module, *, layers=None) -> bool:
    return all(getattr(layer.forward, "__func__", None) is _checkpointed_forward
               for layer in (decoder_layers(model) if layers is None else layers))
