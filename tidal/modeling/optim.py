"""AdamW over a model trained on prompt groups: the lr schedule, order-independent gradient
accumulators, shard-aware clipping, and the optimizer's checkpoint.

Gradients of a step are summed in accumulators (float32 by default, float64 as an option) as
micro-batches come, and divided once, at the step, by the batch denominator (docs/architecture.md
"Determinism"). A float32 sum depends on its order: the learner adds each group's gradients in index
order whatever order the groups arrive in (tidal/executors/learner/order.py IndexOrderedSum). The trainer's barrier (tidal/executors/trainer/barrier.py) combines several accumulators first;
the critic steps on one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tidal.modeling.loss_scale import LossScaler
from tidal.modeling.optim_config import OptimConfig, lr_factor
from tidal.modeling.parallel import clip_grad_norm_, copy_params_, local


class Gradients:
    """Gradient buffers per loss pass (a name: the trainer's Pass, or one for the critic) over the
    trainable parameters' local shards."""

    def __init__(self, params: list[torch.Tensor], *, passes: tuple[Hashable, ...], dtype: torch.dtype | None):
        self.params = params
        self.by_pass = {name: [torch.zeros_like(local(p), dtype=dtype or p.dtype) for p in params] for name in passes}

    @property
    def passes(self) -> tuple[Hashable, ...]:
        return tuple(self.by_pass)

    def add_from_params_(self, name: Hashable) -> None:
        """Move the parameters' .grad into pass `name`'s buffers (with FSDP: the dp sum of this shard)."""
        self.add_(name, self.take_from_params())

    def take_from_params(self) -> list[torch.Tensor | None]:
        """The parameters' .grad (local shards; None where a parameter had none), taken off them."""
        taken = [local(p.grad) if p.grad is not None else None for p in self.params]
        for p in self.params:
            p.grad = None
        return taken

    def add_(self, name: Hashable, grads: list[torch.Tensor | None]) -> None:
        for acc, g in zip(self.by_pass[name], grads):
            if g is not None:
                acc += g

    def all_reduce_(self, passes, *, group: dist.ProcessGroup, which: list[bool] | None = None) -> None:
        """Sum the buffers over `group`: all of them, or those `which` marks."""
        for name in passes:
            for k, acc in enumerate(self.by_pass[name]):
                if which is None or which[k]:
                    dist.all_reduce(acc, group=group)

    def zero_(self) -> None:
        for accs in self.by_pass.values():
            for acc in accs:
                acc.zero_()

    def set_aside(self) -> list:
        """Before a backward whose gradients must stay apart (a group trained ahead of its turn): the
        parameters' .grad, taken off them to be put back after. Here .grad is taken after every
        backward, so there is nothing to keep."""
        return []

    def put_back(self, kept: list) -> None:
        pass


class InPlaceGradients(Gradients):
    """One loss pass over plain float32 parameters, summed in float32: the parameters' .grad is the
    sum. Autograd adds each backward into it in place (`grad += new`, the same operation an accumulator
    would do, in the same order), so no buffer is kept beside it: 4 bytes a parameter less, what TRL's
    trainer holds. A group trained ahead of its turn backpropagates with the sum set aside."""

    def __init__(self, params: list[torch.Tensor], *, name: Hashable):
        assert all(not isinstance(p, DTensor) and p.dtype == torch.float32 for p in params), "plain float32 only"
        self.params, self.name = params, name

    @property
    def by_pass(self) -> dict:
        for p in self.params:
            if p.grad is None:  # a parameter no loss reached: every rank reduces a zero for it alike
                p.grad = torch.zeros_like(p)
        return {self.name: [p.grad for p in self.params]}

    def add_from_params_(self, name: Hashable) -> None:
        assert name == self.name, (name, self.name)  # autograd has added it already

    def add_(self, name: Hashable, grads: list[torch.Tensor | None]) -> None:
        assert name == self.name, (name, self.name)
        for p, g in zip(self.params, grads):
            if g is not None:  # the first term is the sum, as autograd makes it: not 0 + g
                p.grad = g if p.grad is None else p.grad.add_(g)

    def zero_(self) -> None:
        for p in self.params:
            p.grad = None

    def set_aside(self) -> list:
        kept = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return kept

    def put_back(self, kept: list) -> None:
        for p, g in zip(self.params, kept):
            p.grad = g


def in_place_gradients(params: list[torch.Tensor], *, passes: tuple, cfg: OptimConfig) -> bool:
    """Whether the parameters' .grad can be the accumulator (InPlaceGradients): one loss pass, float32
    sums, plain float32 parameters (no DTensor: tp, FSDP and expert parallel keep their buffers)."""
    return (len(passes) == 1 and not cfg.fp64_accumulation
            and all(not isinstance(p, DTensor) and p.dtype == torch.float32 for p in params))


def fused_adamw(params: list[torch.Tensor]) -> bool | None:
    """torch's fused AdamW (one kernel over every parameter) where its devices have it: on CPU it
    steps 135M parameters in 0.08 s against the per-tensor loop's 0.51 s (bench/optimizer.py). None:
    torch's default, on an NPU (torch has no fused kernel for it) and where DTensors and plain tensors
    mix (expert parallel: the kernel takes them as one list, and DTensor's dispatch refuses that)."""
    kinds = {isinstance(p, DTensor) for p in params}
    return True if len(kinds) == 1 and all(local(p).device.type in ("cpu", "cuda") for p in params) else None


@dataclass(frozen=True)
class Reduction:
    """Gradients summed over `group` at the step: every accumulator, or those `which` marks (one flag per
    trainable parameter, in parameters() order)."""

    group: dist.ProcessGroup
    which: list[bool] | None = None


@dataclass(frozen=True)
class GradLayout:
    """Where a model's trainable parameters live, as much as its optimizer needs to know; its backend
    says (tidal/executors/learner/models.py, tidal/executors/trainer/megatron_models.py), so the optimizer
    names no parallelism."""

    reductions: tuple[Reduction, ...] = ()  # at each step, in this order, before the norm
    mesh: DeviceMesh | None = None  # the ranks the gradient norm's squares are summed over (clip_grad_norm_)
    held_by: list[int] | None = None  # per parameter: the ranks of `mesh` holding each element of a plain tensor
    zero_group: dist.ProcessGroup | None = None  # AdamW's state sharded over it (ZeRO-1); None: whole on each rank
    # per-rank checkpoints (state a dcp reshard cannot place) and the layout a resume must keep; None: dcp's
    saved_layout: dict | None = None


class Optimizer:
    """AdamW with warm-up / cosine schedule and shard-aware clipping over a model's parameters."""

    def __init__(self, model: torch.nn.Module, *, cfg: OptimConfig, total_steps: int, passes: tuple[Hashable, ...],
                 layout: GradLayout, compute: torch.nn.Module | None = None, scaler: LossScaler | None = None):
        """model: the weights the optimizer steps. compute: their lower-precision copy that the
        forwards and backwards run on (its gradients are accumulated; it is refreshed after each
        step); None: the model itself. layout: the gradients' sums at the step, the norm's grid and
        the optimizer state's sharding (GradLayout). scaler: fp16's dynamic loss scale
        (tidal/modeling/loss_scale.py): losses go through `scaled` before their backward, and a step
        whose gradient norm is not finite is skipped."""
        self.model, self.compute = model, compute if compute is not model else None
        self.scaler, self.layout = scaler, layout
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.cfg = cfg
        kwargs = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused_adamw(self.params))
        if layout.zero_group is not None and dist.get_world_size(layout.zero_group) > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.opt = ZeroRedundancyOptimizer(self.params, optimizer_class=torch.optim.AdamW,
                                               process_group=layout.zero_group, **kwargs)
        else:
            self.opt = torch.optim.AdamW(self.params, **kwargs)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(
            s, warmup=cfg.warmup_steps, schedule=cfg.schedule, total=total_steps, floor=cfg.min_lr_ratio))
        compute_params = [p for p in self.compute.parameters() if p.requires_grad] if self.compute else self.params
        if in_place_gradients(compute_params, passes=passes, cfg=cfg):
            self.grads = InPlaceGradients(compute_params, name=passes[0])
        else:
            self.grads = Gradients(compute_params, passes=passes,
                                   dtype=torch.float64 if cfg.fp64_accumulation else torch.float32)

    def reduce_(self, passes) -> None:
        """Sum the accumulators of `passes` as the layout says (FSDP reduce-scattered each micro-step's already)."""
        for r in self.layout.reductions:
            if dist.get_world_size(r.group) > 1:
                self.grads.all_reduce_(passes, group=r.group, which=r.which)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate: times the loss scale under fp16 (its gradients land S x too large,
        in fp16's range; `apply` divides them back), else itself."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    def apply(self, grads: list[torch.Tensor], *, denom: float) -> tuple[float, float]:
        """Step on the summed gradients `grads` / denom: clip, AdamW, refresh the compute copy; zero
        every accumulator. Returns (the gradient norm before clipping, the lr stepped with). Under a loss
        scale, a non-finite norm (an fp16 overflow on some rank: the norm is global) skips the step."""
        assert denom > 0, "optimizer step with an empty mini-batch"
        if self.scaler is not None:
            denom *= self.scaler.scale
        if all(g is p.grad for g, p in zip(grads, self.params)):  # InPlaceGradients: normalised where they are
            for g in grads:
                g.div_(denom)
        else:
            normalised = [(grad / denom).to(p.dtype) for grad, p in zip(grads, self.params)]
            self.grads.zero_()
            for g, p in zip(normalised, self.params):
                p.grad = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                            run_check=False) if isinstance(p, DTensor) else g
        grad_norm = clip_grad_norm_(self.params, self.cfg.grad_clip, mesh=self.layout.mesh, held_by=self.layout.held_by)
        lr = self.opt.param_groups[0]["lr"]
        if self.scaler is not None and not self.scaler.update(grad_norm):
            self.opt.zero_grad(set_to_none=True)  # the weights, their compute copy and AdamW's moments unchanged
            return grad_norm, lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.compute is not None:  # the bf16 weights of the next forwards, cast from the stepped master
            copy_params_(self.compute, self.model)
        return grad_norm, lr

    def end_of_batch(self) -> None:
        self.sched.step()

    def move_state_(self, device: torch.device) -> None:
        """Move AdamW's moments to `device` (placement=colocated: to host memory while the engine
        generates on the device, back before training). The step counts stay where AdamW keeps them."""
        for state in self._local().state.values():
            for key, value in state.items():
                if key != "step" and torch.is_tensor(value):
                    state[key] = value.to(device)

    # ---- checkpoints: torch.distributed.checkpoint keys the optimizer state by parameter name and
    # records each shard's place in the full tensor, so a run saved under one layout (dp, tp, FSDP)
    # loads under another; the schedule is a few numbers, written by the leader as JSON.
    def save(self, path: Path, *, group, leader: bool) -> None:
        if self.layout.saved_layout is not None:
            return self._save_per_rank(path, group=group, leader=leader)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        # before the first optimizer step (partial rollouts: steps that trained nothing) there is no
        # state, and get_optimizer_state_dict would make one by a zero-lr step (AdamW's step count
        # then 1): the run would no longer equal one that was not checkpointed
        if self.opt.state:
            dcp.save({"optimizer": get_optimizer_state_dict(self.model, self.opt)}, checkpoint_id=path,
                     process_group=group)
        if leader:
            path.mkdir(parents=True, exist_ok=True)
            self._save_schedule(path)

    def load(self, path: Path, *, group) -> None:
        if self.layout.saved_layout is not None:
            return self._load_per_rank(path, group=group)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        if (path / ".metadata").is_file():  # else saved before the first optimizer step: nothing to load
            # the template in this run's layout: dcp reads each shard's slice of the saved tensors into it
            state = {"optimizer": get_optimizer_state_dict(self.model, self.opt)}
            dcp.load(state, checkpoint_id=path, process_group=group)
            set_optimizer_state_dict(self.model, self.opt, state["optimizer"])
        self._load_schedule(path)

    def _save_schedule(self, path: Path) -> None:
        """The lr schedule's position, and fp16's loss scale (a resume skips and scales as the run would have)."""
        (path / "schedule.json").write_text(json.dumps(self.sched.state_dict()))
        if self.scaler is not None:
            (path / "loss_scale.json").write_text(json.dumps(self.scaler.state_dict()))

    def _load_schedule(self, path: Path) -> None:
        self.sched.load_state_dict(json.loads((path / "schedule.json").read_text()))
        if self.scaler is not None and (path / "loss_scale.json").is_file():  # else saved in fp32/bf16: a fresh scale
            self.scaler.load_state_dict(json.loads((path / "loss_scale.json").read_text()))

    # ---- per-rank checkpoints (GradLayout.saved_layout: megatron's plain tp-sharded tensors and ZeRO's share
    # of the state carry no global layout dcp could reshard): each rank its own file; a resume keeps the layout
    def _local(self) -> torch.optim.Optimizer:
        return getattr(self.opt, "optim", self.opt)  # ZeRO's own share, or the whole AdamW

    def _save_per_rank(self, path: Path, *, group, leader: bool) -> None:
        path.mkdir(parents=True, exist_ok=True)
        torch.save(self._local().state_dict(), path / f"optimizer.rank{dist.get_rank(group)}.pt")
        if leader:
            self._save_schedule(path)
            (path / "layout.json").write_text(json.dumps(self.layout.saved_layout))

    def _load_per_rank(self, path: Path, *, group) -> None:
        saved = json.loads((path / "layout.json").read_text())
        # tidal/launch/run.py refuses another layout before any rank starts
        assert saved == self.layout.saved_layout, (path, saved, self.layout.saved_layout)
        self._local().load_state_dict(torch.load(path / f"optimizer.rank{dist.get_rank(group)}.pt"))
        self._load_schedule(path)
