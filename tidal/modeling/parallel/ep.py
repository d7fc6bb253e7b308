"""Expert parallel: an MoE model's experts split over the trainer's dp ranks (`trainer.ep`).

Consecutive groups of `ep` dp ranks share one set of experts: rank j of a group holds experts
[j·E/ep, (j+1)·E/ep) of every routed layer (DTensors, Shard(0) over the group's 1-D "ep" mesh, so
checkpoints, clipping and the push see where each lives). Everything else stays replicated over dp.
In each routed layer a rank sends every (token, chosen expert) pair to the expert's owner
(all-to-all), the owner runs its experts on what it received, and a second all-to-all brings the
outputs back, where the router's weights mix them. Both are autograd all-to-alls, so the backward
runs the same exchange in reverse: an expert's gradient gathers every token routed to it, from
every rank of its group, on its owner; the replicas of one expert (dp / ep of them) are summed at
the barrier like the replicated weights are over dp (tidal/modeling/optim.py).
Every forward is a collective over the group, so its ranks take their micro-steps in lockstep
(tidal/executors/learner/order.py), as FSDP's do.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from tidal.modeling.moe import FAMILIES, check_ep, moe_shape
from tidal.modeling.parallel.mesh import build_mesh


def expert_mesh(ranks, *, ep: int, device_type: str, parent: dist.ProcessGroup | None) -> DeviceMesh:
    """("edp", "ep") over the trainer's ranks (tp = 1): "ep" rows share a set of experts, "edp"
    columns hold the same experts."""
    return build_mesh(ranks=ranks, tp=ep, device_type=device_type, parent=parent, names=("edp", "ep"))


class ExpertParallel(nn.Module):
    """A drop-in for an HF experts module (3-D `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]),
    holding this rank's E/ep experts under the same parameter names."""

    def __init__(self, experts: nn.Module, *, mesh: DeviceMesh):
        super().__init__()
        self.group, self.ep, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        self.num_experts = experts.num_experts
        self.local = self.num_experts // self.ep
        self.act_fn = experts.act_fn
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            shard = full.detach()[rank * self.local:(rank + 1) * self.local].clone()
            setattr(self, name, nn.Parameter(DTensor.from_local(shard, mesh, [Shard(0)], run_check=False),
                                             requires_grad=full.requires_grad))

    def forward(self, hidden_NH: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        N, k = top_k_index.shape
        expert_A = top_k_index.reshape(-1)  # one assignment per (token, choice)
        order_A = torch.argsort(expert_A, stable=True)  # by expert, hence by owner
        token_A, expert_A = order_A // k, expert_A[order_A]
        send_R = torch.bincount(expert_A // self.local, minlength=self.ep)
        recv_R = torch.empty_like(send_R)
        dist.all_to_all_single(recv_R, send_R, group=self.group)
        send, recv = send_R.tolist(), recv_R.tolist()
        x_MH = _exchange(hidden_NH[token_A], recv, send, self.group)
        local_M = torch.empty(sum(recv), dtype=expert_A.dtype, device=expert_A.device)
        dist.all_to_all_single(local_M, expert_A % self.local, recv, send, group=self.group)
        y_MH = self._experts(x_MH, local_M)
        y_AH = _exchange(y_MH, send, recv, self.group)
        y_AH = y_AH * top_k_weights.reshape(-1)[order_A, None]
        return torch.zeros_like(hidden_NH).index_add_(0, token_A, y_AH.to(hidden_NH.dtype))

    def _experts(self, x_MH: torch.Tensor, local_M: torch.Tensor) -> torch.Tensor:
        """Each local expert on its rows (they arrive grouped by sender, each sender's sorted by expert)."""
        order = torch.argsort(local_M, stable=True)
        counts = torch.bincount(local_M, minlength=self.local).tolist()
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
        outs, start = [], 0
        x_sorted = x_MH[order]
        for e, n in enumerate(counts):
            if n:
                gate, up = nn.functional.linear(x_sorted[start:start + n], gate_up[e]).chunk(2, dim=-1)
                outs.append(nn.functional.linear(self.act_fn(gate) * up, down[e]))
            start += n
        # with no rows, the graph still runs from the first exchange to the second: a rank whose
        # backward skipped them would leave its peers waiting in theirs
        y_sorted = torch.cat(outs) if outs else x_MH * 0
        return torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """All-to-all of rows, with autograd (its backward is the reverse exchange). Functional
    collectives' version: torch.distributed.nn's is deprecated (a warning on every rank)."""
    return funcol.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)


def apply_ep(model: nn.Module, *, mesh: DeviceMesh) -> nn.Module:
    """Swap each experts module for this rank's `ExpertParallel` share, in place."""
    shape = moe_shape(model.config)
    if shape is None:
        raise ValueError(f"trainer.ep={mesh.size()} needs a mixture-of-experts model (model_type "
                         f"{getattr(model.config, 'model_type', None)!r} has no experts)")
    check_ep(shape.experts, ep=mesh.size())
    family = FAMILIES.get(model.config.model_type)
    for name, module in list(model.named_modules()):
        if type(module).__name__ == family.experts:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, ExpertParallel(module, mesh=mesh))
    return model


def is_expert(model: nn.Module) -> list[bool]:
    """Per trainable parameter, whether it is split over ep (its replicas are the "edp" column)."""
    owners = {id(p) for m in model.modules() if isinstance(m, ExpertParallel) for p in m.parameters()}
    return [id(p) in owners for p in model.parameters() if p.requires_grad]
