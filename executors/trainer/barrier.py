"""The trainer's barrier: reduce over dp, normalise once by the batch denominator, clip, step.

Batch-level denominators (1/(B·G), DAPO's 1/total-tokens) are applied here, once, to the
accumulated gradient: gradients are linear in the loss, so dividing the sum at the end equals
dividing each term (DESIGN.md "Normalisation that survives streaming"). For batch-scope
advantages the first pass's three gradients are combined here too (algorithms/batch_scope.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from algorithms.batch_scope import batch_normalise_at_barrier
from executors.parallel import clip_grad_norm_, copy_params_, local
from executors.trainer.accumulate import LossSums, Pass
from executors.trainer.config import TrainerConfig, lr_factor


class Gradients:
    """Per-pass gradient buffers over the trainable parameters' local shards. float64 by default, so
    the sum of a step's float32 micro-batch gradients cannot depend on their order (DESIGN.md
    "Determinism", rule 3)."""

    def __init__(self, params: list[torch.Tensor], *, passes: tuple[Pass, ...], dtype: torch.dtype | None):
        self.params = params
        self.by_pass = {name: [torch.zeros_like(local(p), dtype=dtype or p.dtype) for p in params] for name in passes}

    @property
    def passes(self) -> tuple[Pass, ...]:
        return tuple(self.by_pass)

    def add_from_params_(self, name: Pass) -> None:
        """Move the parameters' .grad into pass `name`'s buffers (with FSDP: the dp sum of this shard)."""
        for acc, p in zip(self.by_pass[name], self.params):
            if p.grad is not None:
                acc += local(p.grad)
                p.grad = None

    def all_reduce_(self, passes, *, group: dist.ProcessGroup) -> None:
        for name in passes:
            for acc in self.by_pass[name]:
                dist.all_reduce(acc, group=group)

    def zero_(self) -> None:
        for accs in self.by_pass.values():
            for acc in accs:
                acc.zero_()


@dataclass(frozen=True)
class OptimizerStep:
    """What one optimizer step reports."""

    loss: float  # summed over the batch (batch scope: combined at the batch's mean and scale)
    denom: float
    kl_sum: float
    clip_sum: float
    entropy_sum: float
    entropy_tokens: float
    grad_norm: float  # before clipping
    mismatch: float
    lr: float
    ratio_sum: float = 0.0
    ratio_max: float = 0.0


class Barrier:
    """AdamW with warm-up / cosine schedule and shard-aware clipping over the policy's parameters."""

    def __init__(self, policy: torch.nn.Module, *, cfg: TrainerConfig, total_steps: int, mesh, dp_group,
                 passes: tuple[Pass, ...], replicated_dp: bool, compute: torch.nn.Module | None = None):
        """policy: the weights the optimizer steps. compute: their lower-precision copy that the
        forwards and backwards run on (its gradients are accumulated; it is refreshed after each
        step); None: the policy itself."""
        self.policy, self.compute = policy, compute if compute is not policy else None
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.cfg, self.mesh, self.dp_group = cfg, mesh, dp_group
        self.replicated_dp = replicated_dp  # dp replicas hold full copies: their gradients need a sum
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                                     weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(
            s, warmup=cfg.warmup_steps, schedule=cfg.lr_schedule, total=total_steps, floor=cfg.min_lr_ratio))
        compute_params = [p for p in self.compute.parameters() if p.requires_grad] if self.compute else self.params
        self.grads = Gradients(compute_params, passes=passes,
                               dtype=torch.float64 if cfg.fp64_grad_accumulation else torch.float32)

    def step(self, sums: LossSums, *, passes: tuple[Pass, ...],
             mu_scale: tuple[float, float] | None) -> OptimizerStep:
        """One optimizer step from the accumulated `passes`; `mu_scale`: the batch's mean and scale
        when the first pass of a batch-scope algorithm is combined, else None."""
        sums = sums.all_reduce(group=self.dp_group)
        if self.replicated_dp and self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            # (FSDP reduce-scattered each micro-step's gradients already)
            self.grads.all_reduce_(passes, group=self.dp_group)
        by_pass, loss = self.grads.by_pass, sums.loss[Pass.SCORE]
        grads = by_pass[Pass.SCORE]
        if mu_scale is not None:
            mu, scale = mu_scale
            zero = Pass.ZERO in by_pass
            grads = [batch_normalise_at_barrier(at_score=s, at_one=o, at_zero=z, mu=mu, scale=scale)
                     for s, o, z in zip(by_pass[Pass.SCORE], by_pass[Pass.ONE],
                                        by_pass[Pass.ZERO] if zero else [None] * len(self.params))]
            loss = batch_normalise_at_barrier(at_score=sums.loss[Pass.SCORE], at_one=sums.loss[Pass.ONE],
                                              at_zero=sums.loss[Pass.ZERO] if zero else None, mu=mu, scale=scale)
        assert sums.denom > 0, "optimizer step with an empty mini-batch"
        for grad, p in zip(grads, self.params):
            g = (grad / sums.denom).to(p.dtype)
            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                        run_check=False) if isinstance(p, DTensor) else g
        self.grads.zero_()
        grad_norm = clip_grad_norm_(self.params, self.cfg.grad_clip, mesh=self.mesh)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.compute is not None:  # the bf16 weights of the next forwards, cast from the stepped master
            copy_params_(self.compute, self.policy)
        return OptimizerStep(loss, sums.denom, sums.kl_sum, sums.clip_sum, sums.entropy_sum, sums.entropy_tokens,
                             grad_norm, sums.mismatch, lr, sums.ratio_sum, sums.ratio_max)

    def end_of_batch(self) -> None:
        self.sched.step()

    # ---- checkpoints: torch.distributed.checkpoint keys the optimizer state by parameter name and
    # records each shard's place in the full tensor, so a run saved under one layout (dp, tp, FSDP)
    # loads under another; the schedule is a few numbers, written by the leader as JSON.
    def save(self, path: Path, *, group, leader: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        dcp.save({"optimizer": get_optimizer_state_dict(self.policy, self.opt)}, checkpoint_id=path,
                 process_group=group)
        if leader:
            (path / "schedule.json").write_text(json.dumps(self.sched.state_dict()))

    def load(self, path: Path, *, group) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        # the template in this run's layout: dcp reads each shard's slice of the saved tensors into it
        state = {"optimizer": get_optimizer_state_dict(self.policy, self.opt)}
        dcp.load(state, checkpoint_id=path, process_group=group)
        set_optimizer_state_dict(self.policy, self.opt, state["optimizer"])
        self.sched.load_state_dict(json.loads((path / "schedule.json").read_text()))
