"""Tensor parallelism for HF decoder models: one DTensor `parallelize_module` plan per family.

Megatron-style: q/k/v and gate/up are split by output rows (colwise), o/down by input columns
(rowwise), so each attention head and each MLP column lives on one tp rank and a layer needs one
all-reduce after attention and one after the MLP. The embedding and lm_head are split over the
vocabulary (their weight is tied in small models; both split on dim 0, so the tie survives).
Everything else is a replicated DTensor, so every parameter of a parallelized model is a DTensor
on the same mesh and optimizers, grad clipping and FSDP2 see one kind of tensor.

GQA: kv heads are split, not replicated, so tp must divide the kv head count as well.
"""
from __future__ import annotations

import fnmatch

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tidal.channels.payloads import ParamSpec
from tidal.modeling.moe import expert_modules


class ReplicateParallel(ParallelStyle):
    """Parameters become replicated DTensors; inputs and outputs stay plain (replicated) tensors.

    For norms on the replicated residual stream: their gradients come out identical on every tp
    rank (the stream's gradient is all-reduced by the colwise layers' backward), so no sync.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        def to_local(mod, outputs, mesh):
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        # partition_fn=None: replicate every parameter, broadcast from the mesh's first rank
        return distribute_module(module, device_mesh, None, to_dtensor, to_local)


class HeadShardedNorm(SequenceParallel):
    """A norm with a replicated weight applied to head-sharded activations (Qwen3 q_norm/k_norm).

    Input [B, L, heads_local, head_dim] is marked sharded on the head dim. Each tp rank sees only
    its heads, so its weight gradient is a partial sum (DTensor Partial). Left alone, the optimizer
    would step each replica with its own partial gradient and the replicas would drift apart; the
    hook `apply_tp` puts on every parameter all-reduces the gradient to the parameter's Replicate
    placement as it is produced. (FSDP2 does the same redistribution itself, but plain tp /
    replicated dp would not.)
    """

    def __init__(self):
        super().__init__(sequence_dim=2, use_local_output=True)


def _grad_like_param(placements):
    def hook(grad: DTensor) -> DTensor:
        return grad if grad.placements == placements else grad.redistribute(placements=placements)
    return hook


_COMMON = {
    "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
    "model.layers.*.input_layernorm": ReplicateParallel(),
    "model.layers.*.self_attn.q_proj": ColwiseParallel(),
    "model.layers.*.self_attn.k_proj": ColwiseParallel(),
    "model.layers.*.self_attn.v_proj": ColwiseParallel(),
    "model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "model.layers.*.post_attention_layernorm": ReplicateParallel(),
    "model.layers.*.mlp.gate_proj": ColwiseParallel(),
    "model.layers.*.mlp.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
    "model.norm": ReplicateParallel(),
    "lm_head": ColwiseParallel(output_layouts=Replicate()),
}

PLANS: dict[str, dict[str, ParallelStyle]] = {
    "llama": dict(_COMMON),
    "qwen2": dict(_COMMON),
    "qwen3": {**_COMMON,
              "model.layers.*.self_attn.q_norm": HeadShardedNorm(),
              "model.layers.*.self_attn.k_norm": HeadShardedNorm()},
}


def tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    plan = _family_plan(model.config)
    if model.get_output_embeddings() is None:  # a value model (token classification): a replicated scalar head
        del plan["lm_head"]
        plan["score"] = ReplicateParallel()
    return plan


def _family_plan(config) -> dict[str, ParallelStyle]:
    family = getattr(config, "model_type", None)
    if family not in PLANS:
        raise ValueError(f"no tensor-parallel plan for model_type={family!r}; known: {sorted(PLANS)}")
    return dict(PLANS[family])


def check_tp(config, *, tp: int) -> None:
    """Can a model with this config run tensor parallel over `tp` ranks? A ValueError says why not."""
    if tp > 1:
        _family_plan(config)
        check_divisible(config, tp=tp)


def check_divisible(config, *, tp: int) -> None:
    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        listed = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(f"tp={tp} must divide {listed} (kv heads are split across tp ranks, not "
                         f"replicated, and the vocabulary is split for the embedding and lm_head)")


def apply_tp(model: nn.Module, *, mesh: DeviceMesh, plan: dict[str, ParallelStyle] | None = None) -> nn.Module:
    """Shard `model` in place over the 1-D tp `mesh` with its family's plan (or `plan`)."""
    check_divisible(model.config, tp=mesh.size())
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    parallelize_module(model, mesh, plan if plan is not None else tp_plan(model))
    if tied:  # each style distributed its own copy of the shared weight; both are Shard(0)
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    # A gradient must have its parameter's placements, or the optimizer and the accumulators see
    # another shape. Two do not by themselves: HeadShardedNorm's (Partial, above) and an untied
    # embedding's (Replicate: the embedding backward of a vocab-sharded weight gives the full-vocab
    # gradient on every tp rank; a tied lm_head's Shard(0) gradient hid it). Redistributing a
    # matching gradient is a no-op.
    for p in model.parameters():
        if isinstance(p, DTensor):
            p.register_hook(_grad_like_param(p.placements))
    return model


def _tp_dim(style: ParallelStyle, module: nn.Module, param_name: str) -> int | None:
    if isinstance(style, ColwiseParallel):
        return 0  # Linear weight [out, in] and bias [out]: output rows
    if isinstance(style, RowwiseParallel):
        if isinstance(module, nn.Embedding):
            return 0  # vocabulary rows
        return 1 if param_name == "weight" else None  # bias is added after the all-reduce
    return None


def param_specs(model: nn.Module) -> dict[str, ParamSpec]:
    """Global shape, dtype and tp split dim of every parameter, in `named_parameters` order.

    Derived from the family plan, not from DTensor placements, so a parallelized trainer model and
    an unsharded generator model of the same architecture give the same specs (a push plan must be
    built identically on both sides).
    """
    # a family without a plan cannot run tp > 1 (apply_tp refuses it), so everything is replicated
    plan = PLANS.get(getattr(model.config, "model_type", None), {})
    modules = dict(model.named_modules())
    experts = expert_modules(model)  # their weights split over the trainer's ep ranks on dim 0
    out = {}
    for name, p in model.named_parameters():
        mod_name, _, p_name = name.rpartition(".")
        style = next((s for pattern, s in plan.items() if _match(pattern, mod_name)), None)
        out[name] = ParamSpec(shape=tuple(p.shape), dtype=p.dtype,
                              tp_dim=_tp_dim(style, modules[mod_name], p_name) if style else None,
                              ep_dim=0 if mod_name in experts else None)
    return out


def _match(pattern: str, fqn: str) -> bool:
    atoms, parts = pattern.split("."), fqn.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for p, a in zip(parts, atoms))
