"""How a learner's model is laid out: its mesh, the copy its forwards run on, its parallel transforms,
and a prompt group's micro-batches. The trainer's tri-model and the critic's value model both build
from these, so a layout means the same on both.
"""
from __future__ import annotations

import copy
import functools
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tidal.modeling import moe
from tidal.executors.base import ExecutorEnv
from tidal.modeling.hf import cast_parameters, save_hf
from tidal.modeling.optim import GradLayout, Reduction
from tidal.modeling.parallel import apply_ac, build_mesh, full_state_dict, parallelize
from tidal.modeling.parallel.cp import ContextGroups
from tidal.modeling.batching import Routes
from tidal.executors.learner.config import LearnerConfig
from tidal.modeling.packing import auto_shared_prompt, make_micro_batches

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # the compute dtype; None: the weights' own


def learner_mesh(env: ExecutorEnv, cfg: LearnerConfig) -> DeviceMesh | None:
    """("dp", "tp") over the executor's own ranks; None: one process without torch.distributed."""
    if not dist.is_initialized():
        return None
    return build_mesh(ranks=env.ranks, tp=cfg.tp, device_type=env.device.type, parent=env.group)


def trainable_copy(master: nn.Module, cfg: LearnerConfig) -> nn.Module:
    """The model the forwards and backwards run on: `master` itself, or under precision=bf16/fp16
    without FSDP its bf16/fp16 copy (FSDP2 casts the sharded master itself); each decoder layer checkpointed
    with activation_checkpointing (forward-only copies made from it later are unaffected)."""
    compute = PRECISIONS[cfg.precision]
    model = cast_parameters(copy.deepcopy(master), compute) if compute is not None and not cfg.fsdp else master
    if cfg.activation_checkpointing:
        apply_ac(model)
    return model


def lay_out(models: list[tuple[nn.Module | None, bool]], *, mesh: DeviceMesh | None, cfg: LearnerConfig,
            ep_mesh: DeviceMesh | None = None) -> None:
    """Expert parallel, tensor parallel and/or FSDP2 on each (model, forward_only), in place; the copies
    of one learner share its layout, so one micro-batch feeds all of them on the same ranks."""
    for model, forward_only in models:
        if model is not None and ep_mesh is not None:
            from tidal.modeling.parallel.ep import apply_ep

            apply_ep(model, mesh=ep_mesh["ep"])
        if model is not None and (cfg.tp > 1 or cfg.fsdp):
            parallelize(model, mesh=mesh, tp=cfg.tp > 1, fsdp=cfg.fsdp, forward_only=forward_only,
                        param_dtype=PRECISIONS[cfg.precision])


def shares_prompt(cfg: LearnerConfig, prompt_ids_P: torch.Tensor, responses: list[torch.Tensor]) -> bool:
    mode = cfg.shared_prompt
    return mode == "on" or (mode == "auto" and auto_shared_prompt(prompt_ids_P.numel(), [r.numel() for r in responses]))


def micro_batches(cfg: LearnerConfig, prompt_ids_P: torch.Tensor, responses: list[torch.Tensor], *, pad_id: int,
                  device: torch.device, loss_masks: list[torch.Tensor] | None = None,
                  routes: Routes | None = None) -> list:
    """A group's micro-batches: fixed by the group alone (sample index order), never by arrival
    (docs/architecture.md, determinism rule 2). loss_masks: the tokens trained (RolloutGroup.loss_masks). routes:
    an MoE model's recorded routing (tidal/modeling/moe.py)."""
    return make_micro_batches(prompt_ids_P, responses, mode=cfg.shared_prompt, token_budget=cfg.token_budget,
                              micro_batch_size=cfg.micro_batch_size, pad_id=pad_id, device=device,
                              loss_masks=loss_masks, routes=routes)


class LearnerModels:
    """What the trainer's and the critic's model holders share: a group's micro-batches, the
    lockstep dummy, the dp group. Subclasses are dataclasses with `cfg`, `tokenizer`, `device`, `mesh`."""

    cfg: LearnerConfig
    mesh: DeviceMesh | None
    device: torch.device
    moe_shape: moe.MoeShape | None = None  # an MoE model's, whose forwards replay or compare its recorded routing
    ep_mesh: DeviceMesh | None = None  # ("edp", "ep") under expert parallel
    cp: ContextGroups | None = None  # with trainer.cp > 1 (tidal/modeling/parallel/cp.py)

    def routing_counts(self) -> tuple[int, int]:
        """(tokens with a recorded routing, those whose own top-k differed) in the last policy forward."""
        return 0, 0

    def expert_params(self) -> list[bool] | None:
        """Per trainable parameter, whether it is split over expert-parallel ranks; None: no expert parallel."""
        return None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The dp units' ranks at this rank's place: the step's records and lockstep rounds (a unit's cp ranks
        hold copies of the same record)."""
        if self.cp is not None:
            return self.cp.data
        return self.mesh.get_group("dp") if self.mesh is not None else None

    def grad_layout(self) -> GradLayout:
        """The optimizer's view of this layout: dp replicas sum their gradients (FSDP's shards did at each
        micro-step), an expert's over its replicas alone; the norm over the mesh; AdamW whole on each rank
        (DTensor parameters: dcp reshards its state across layouts)."""
        experts, reductions = self.expert_params(), []
        if self.mesh is not None and not self.cfg.shards_over_units:
            # the mesh's dp spans dp x cp: a cp rank's gradient is its tokens' part of the row's
            reductions.append(Reduction(self.mesh.get_group("dp"), which=None if experts is None else [not e for e in experts]))
            if experts is not None:
                reductions.append(Reduction(self.ep_mesh.get_group("edp"), which=experts))
        return GradLayout(reductions=tuple(reductions), mesh=self.mesh)

    def micro_batches(self, group) -> list:
        routes = None
        if self.moe_shape is not None and group.routing is not None:
            routes = Routes(*moe.unpack(group.routing, self.moe_shape))
        return micro_batches(self.cfg, group.prompt_ids, group.responses, pad_id=self.tokenizer.pad_token_id,
                             device=self.device, loss_masks=group.loss_masks, routes=routes)

    @functools.cached_property
    def dummy(self):
        """A one-token micro-batch for lockstep padding: it runs every collective a real one does."""
        pad = torch.tensor([self.tokenizer.pad_token_id])
        return micro_batches(self.cfg, pad, [pad], pad_id=pad.item(), device=self.device)[0]


@torch.no_grad()
def frozen_logprobs(model: nn.Module | None, mbs: list, *, pad_to: int, dummy,
                    logprobs: Callable[[nn.Module, object], torch.Tensor]) -> list:
    """A frozen model's (the reference's) `logprobs(model, mb)` per micro-batch, then forwards of
    lockstep dummies up to `pad_to` micro-steps (the same collectives as a real micro-batch);
    [None] * len(mbs) without a model."""
    if model is None:
        return [None] * len(mbs)
    refs = [logprobs(model, mb) for mb in mbs]
    for _ in range(pad_to - len(mbs)):
        logprobs(model, dummy)
    return refs


def save_full(model: nn.Module, tokenizer, path, *, leader: bool) -> None:
    """The full model as an HF directory: every rank gathers its shards, the leader writes."""
    state = full_state_dict(model, keep=leader)
    if leader:
        save_hf(model, tokenizer, path, state=state)
