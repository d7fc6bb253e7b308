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
from pathlib import Path
from typing import Hashable

import torch
import torch.distributed as dist
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


class Optimizer:
    """AdamW with warm-up / cosine schedule and shard-aware clipping over a model's parameters."""

    def __init__(self, model: torch.nn.Module, *, cfg: OptimConfig, total_steps: int, mesh, dp_group,
                 passes: tuple[Hashable, ...], replicated_dp: bool, compute: torch.nn.Module | None = None,
                 tp_partial: list[bool] | None = None, zero: bool = False, experts: list[bool] | None = None,
                 edp_group: dist.ProcessGroup | None = None, scaler: LossScaler | None = None,
                 tied: list[bool] | None = None, tied_group: dist.ProcessGroup | None = None):
        """model: the weights the optimizer steps. compute: their lower-precision copy that the
        forwards and backwards run on (its gradients are accumulated; it is refreshed after each
        step); None: the model itself. tp_partial: per trainable parameter, whether its gradient is a
        partial sum over mesh["tp"] (megatron's q/k norms). zero: shard AdamW's state over dp (ZeRO-1:
        each dp rank steps a share of the parameters and broadcasts them); its checkpoint is per rank.
        experts: per trainable parameter, whether it is split over expert-parallel ranks; its replicas
        are `edp_group`, over which alone its gradient sums (tidal/modeling/parallel/ep.py). scaler: fp16's
        dynamic loss scale (tidal/modeling/loss_scale.py): losses go through `scaled` before their backward,
        and a step whose gradient norm is not finite is skipped. tied: per trainable parameter, whether it
        is one of a tied embedding's two copies on the first and last pipeline stages, whose gradients are
        summed over `tied_group` so both copies take the same step (tidal/modeling/megatron/stages.py)."""
        self.model, self.compute = model, compute if compute is not model else None
        self.scaler = scaler
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.cfg, self.mesh, self.dp_group = cfg, mesh, dp_group
        self.replicated_dp = replicated_dp  # dp replicas hold full copies: their gradients need a sum
        self.tp_partial = tp_partial or [False] * len(self.params)
        self.experts, self.edp_group = experts, edp_group
        self.tied, self.tied_group = tied, tied_group
        kwargs = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused_adamw(self.params))
        self.per_rank = zero
        if zero and dp_group is not None and dist.get_world_size(dp_group) > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.opt = ZeroRedundancyOptimizer(self.params, optimizer_class=torch.optim.AdamW,
                                               process_group=dp_group, **kwargs)
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
        """Sum the accumulators of `passes` over dp replicas (FSDP reduce-scattered each micro-step's already)."""
        if self.replicated_dp and self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dense = None if self.experts is None else [not e for e in self.experts]
            self.grads.all_reduce_(passes, group=self.dp_group, which=dense)
            if self.experts is not None and dist.get_world_size(self.edp_group) > 1:
                self.grads.all_reduce_(passes, group=self.edp_group, which=self.experts)
        if self.tied_group is not None and any(self.tied):
            self.grads.all_reduce_(passes, group=self.tied_group, which=self.tied)
        if any(self.tp_partial) and self.mesh["tp"].size() > 1:
            for name in passes:
                for acc, partial in zip(self.grads.by_pass[name], self.tp_partial):
                    if partial:
                        dist.all_reduce(acc, group=self.mesh.get_group("tp"))

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
        grad_norm = clip_grad_norm_(self.params, self.cfg.grad_clip, mesh=self.mesh)
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
        if self.per_rank:
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
        if self.per_rank:
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

    # ---- per-rank checkpoints (zero=True: megatron's plain tp-sharded tensors and ZeRO's share of the
    # state carry no global layout dcp could reshard): each rank its own file; a resume keeps the layout
    def _layout(self, group) -> dict:
        names = (self.mesh.mesh_dim_names or ()) if self.mesh is not None else ()
        tp = self.mesh["tp"].size() if "tp" in names else 1
        layout = {"ranks": dist.get_world_size(group), "dp": dist.get_world_size(group) // tp, "tp": tp}
        if "pp" in names:  # a layout saved before pipeline stages existed reads as pp 1 (no key)
            layout |= {"dp": layout["dp"] // self.mesh["pp"].size(), "pp": self.mesh["pp"].size()}
        return layout

    def _local(self) -> torch.optim.Optimizer:
        return getattr(self.opt, "optim", self.opt)  # ZeRO's own share, or the whole AdamW

    def _save_per_rank(self, path: Path, *, group, leader: bool) -> None:
        path.mkdir(parents=True, exist_ok=True)
        torch.save(self._local().state_dict(), path / f"optimizer.rank{dist.get_rank(group)}.pt")
        if leader:
            self._save_schedule(path)
            (path / "layout.json").write_text(json.dumps(self._layout(group)))

    def _load_per_rank(self, path: Path, *, group) -> None:
        saved = json.loads((path / "layout.json").read_text())
        # tidal/launch/run.py refuses another layout before any rank starts
        assert saved == self._layout(group), (path, saved, self._layout(group))
        self._local().load_state_dict(torch.load(path / f"optimizer.rank{dist.get_rank(group)}.pt"))
        self._load_schedule(path)
