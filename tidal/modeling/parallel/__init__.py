"""Trainer parallelism: a ("dp", "tp") mesh over the executor's ranks, DTensor tensor parallel,
FSDP2, and the small helpers a training loop needs around them.

    mesh = build_mesh(ranks=env.ranks, tp=cfg.tp, device_type=env.device.type, parent=env.group)
    policy = parallelize(policy, mesh=mesh, tp=cfg.tp > 1, fsdp=cfg.fsdp)
    reference = parallelize(reference, mesh=mesh, tp=cfg.tp > 1, fsdp=cfg.fsdp, forward_only=True)

Order matters: tp first (DTensors on mesh["tp"]), then FSDP2 over mesh["dp"], which shards the tp
shards once more along dim 0 (FSDP2 turns them into 2-D DTensors on the whole mesh).

Context parallel (trainer.cp, cp.py) splits a row's tokens, not the model: to this mesh a unit's cp ranks are
dp ranks (its dp dimension spans dp x cp), and cp.py's own groups carry the row's keys and the step's records.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tidal.modeling.parallel.ac import apply_ac, has_ac
from tidal.modeling.parallel.fsdp import apply_fsdp
from tidal.modeling.parallel.mesh import build_mesh, mesh_ranks
from tidal.modeling.parallel.tp import apply_tp, check_divisible, param_specs, tp_plan

__all__ = ["apply_ac", "apply_fsdp", "has_ac", "apply_tp", "build_mesh", "check_divisible", "clip_grad_norm_", "copy_params_",
           "full_state_dict", "local", "local_shards", "mesh_ranks", "param_specs", "parallelize",
           "tp_plan"]


def parallelize(model: nn.Module, *, mesh: DeviceMesh, tp: bool, fsdp: bool, forward_only: bool = False,
                param_dtype: torch.dtype | None = None) -> nn.Module:
    """Apply tensor parallel over mesh["tp"] and/or FSDP2 over mesh["dp"], in place.

    forward_only: the model never runs backward (old policy, reference); with fsdp its root
    reshards after every forward too (see fsdp.py). param_dtype: FSDP2's mixed precision (fsdp.py).
    Without fsdp, dp is plain replication: the caller all-reduces gradients over mesh["dp"].
    """
    if tp:
        apply_tp(model, mesh=mesh["tp"])
    if fsdp:
        apply_fsdp(model, mesh=mesh["dp"], forward_only=forward_only, param_dtype=param_dtype)
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly DTensor) tensor, aliasing its storage."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: this rank's shard} of every parameter, aliasing the parameters' storage."""
    return {name: local(p.detach()) for name, p in model.named_parameters()}


@torch.no_grad()
def full_state_dict(model: nn.Module, *, keep: bool) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on CPU, tied tensors once under their first name.

    Every rank of the model's mesh must call it (a DTensor's full_tensor() is a collective); ranks
    with keep=False take part but keep nothing, so only the writer ever holds the whole model, one
    tensor at a time on the others.
    """
    # named_parameters lists a tied parameter once, under its first name: the same decision on every
    # rank (a data_ptr test would not be: an empty FSDP shard has no storage), so collectives pair up
    first = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    out = {}
    for name, t in model.state_dict().items():
        if name not in first:
            continue
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            out[name] = full.detach().contiguous().cpu()
    return out


@torch.no_grad()
def copy_params_(dst: nn.Module, src: nn.Module) -> None:
    """Copy `src`'s parameters into `dst` (same architecture and layout), shard by shard.

    Through `to_local()`: `_foreach_copy_` rejects lists that mix DTensors and tensors, and a
    DTensor copy would check placements we already know to be equal.
    """
    dst_params, src_params = dict(dst.named_parameters()), dict(src.named_parameters())
    assert dst_params.keys() == src_params.keys(), "copy_params_ needs the same architecture"
    for name, p in dst_params.items():
        local(p).copy_(local(src_params[name]))


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, *, mesh: DeviceMesh | None, held_by: list[int] | None = None) -> float:
    """Clip the global gradient norm of parameters sharded in any mix of layouts over `mesh`.

    Each rank sums the squares of its local shard, weighted so that an element held by k ranks
    counts once; all-reducing over each mesh dimension gives the global sum (no extra group is
    needed). A DTensor's k follows from its placements; a plain tensor's is `held_by`'s entry (its
    backend knows: pipeline stages hold different layers, a tp-cut tensor fewer copies), else every
    rank of the mesh. mesh None: one process, plain tensors. Returns the norm before clipping.
    """
    world = mesh.size() if mesh is not None else 1
    held = [world] * len(params) if held_by is None else held_by
    kept = [(p, k) for p, k in zip(params, held) if p.grad is not None]
    grads = [p.grad for p, _ in kept]
    # on the gradients' device: the sum is all-reduced over the device's groups (nccl takes no CPU tensor)
    sq = torch.zeros((), dtype=torch.float64, device=local(grads[0]).device if grads else "cpu")
    for (_, copies), g in zip(kept, grads):
        if isinstance(g, DTensor):
            assert not any(pl.is_partial() for pl in g.placements), "reduce partial gradients first"
            sharded = 1
            for dim, pl in enumerate(g.placements):
                if not pl.is_replicate():  # Shard, or FSDP2's _StridedShard (its is_shard() is False)
                    sharded *= g.device_mesh.size(dim)
            copies = world // sharded
        # each tensor's norm in float32, the squares summed in float64: a float64 norm took 1.5 of a 0.5B model's
        # 2.2 s barrier on 2 cores (0.38 s a 136M-element embedding, against 0.056 in float32: torch's float32
        # reduction is vectorised; the embedded jobs' norms moved by at most 3.6e-6 relative, nothing to a clip)
        sq += torch.linalg.vector_norm(local(g), dtype=torch.float32).double().square() / copies
    for dim in range(mesh.ndim if mesh is not None else 0):  # a sum over the grid: each dimension in turn
        if mesh.size(dim) > 1:
            dist.all_reduce(sq, group=mesh.get_group(dim))
    norm = sq.sqrt().item()
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            local(g).mul_(coef)
    return norm

