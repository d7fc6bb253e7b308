"""The tri-model: policy, old policy and reference in one parallel layout, and their log-probs.

- policy: the trainable weights.
- old policy: the weights that generated the step's samples. With one optimizer step per batch it
  equals the policy during the whole first pass, so its log-probs are the detached policy's and no
  copy exists; with several optimizer steps per batch (mini-batches, epochs) a real snapshot is kept.
- reference: the initial weights, frozen; only when the algorithm has a KL term. With LoRA
  (trainer.lora, tidal/modeling/lora.py) it is the policy with its adapters off: no copy at all.
The copies are made before sharding and parallelized alike (tidal/modeling/parallel), so one micro-batch
feeds all three on the same ranks without extra communication.

Mixed precision (trainer.precision=bf16): the optimizer steps fp32 master weights and every forward
and backward runs on bf16 weights cast from them. With FSDP the master weights are the sharded
parameters themselves and FSDP2 gathers them in bf16 (parallel/fsdp.py); without it, `master` is a
separate fp32 copy in the same layout and `policy` its bf16 copy, refreshed after each optimizer step.
The old policy and the reference are copies of the bf16 policy. The generator receives bf16 weights.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tidal.channels.payloads import ScoredGroup
from tidal.modeling import moe
from tidal.executors.base import ExecutorEnv
from tidal.modeling.hf import cast_parameters, load_model, load_tokenizer
from tidal.modeling.parallel import copy_params_, local_shards, param_specs
from tidal.executors.trainer.config import TrainerConfig
from tidal.executors.learner.models import (PRECISIONS, LearnerModels, frozen_logprobs, lay_out, learner_mesh, save_full,
                                       shares_prompt, trainable_copy)
from tidal.modeling.attention import install as install_attention
from tidal.modeling.head import Entropy
from tidal.modeling.parallel.cp import ContextGroups, context_groups
from tidal.modeling.parallel.cp import forward as cp_forward


@dataclass
class TriModel(LearnerModels):
    policy: nn.Module  # what the forwards and backwards run on
    old: nn.Module | None
    reference: nn.Module | None
    mesh: DeviceMesh | None  # ("dp", "tp") over the trainer's ranks; None: one rank, no torch.distributed
    tokenizer: object
    cfg: TrainerConfig
    temperature: float
    device: torch.device
    master: nn.Module  # what the optimizer steps and checkpoints save: the policy itself, or its fp32 master copy
    # keyword-only: a backend's subclass adds fields of its own (megatron_models.py)
    ep_mesh: DeviceMesh | None = field(default=None, kw_only=True)  # ("edp", "ep") with trainer.ep > 1
    base_reference: bool = field(default=False, kw_only=True)  # LoRA with a reference: the policy's base, adapters off
    model_path: str | None = field(default=None, kw_only=True)
    cp: ContextGroups | None = field(default=None, kw_only=True)  # trainer.cp > 1: a row's tokens split over these

    @classmethod
    def build(cls, *, model_path: str | None, dtype: torch.dtype, env: ExecutorEnv, cfg: TrainerConfig,
              temperature: float, reference: bool, snapshot: bool, policy_path=None,
              numerics: str = "default") -> "TriModel":
        """policy_path: a checkpoint's HF directory to take the policy from (a resumed run); the
        reference stays the initial model of `model_path`."""
        mesh = learner_mesh(env, cfg)
        cp = context_groups(ranks=env.ranks, cp=cfg.cp, tp=cfg.tp, parent=env.group) if cfg.cp > 1 else None
        compute = PRECISIONS[cfg.precision]
        lora = cfg.lora
        # with LoRA a checkpoint holds the adapters alone: the base is always the model's
        master = load_model(str(policy_path) if policy_path and not lora.on else model_path, dtype=dtype,
                            seed=env.seed).to(env.device).train()
        if lora.on:
            from tidal.modeling.lora import apply_lora, load_adapter

            apply_lora(master, lora, seed=env.seed)
            if policy_path:
                load_adapter(master, policy_path)
        policy = trainable_copy(master, cfg)  # the copies below are forward-only: checkpointing is a no-op there
        initial = policy
        if policy_path and reference and not lora.on:
            initial = load_model(model_path, dtype=dtype, seed=env.seed).to(env.device)
            initial = initial if cfg.fsdp or compute is None else cast_parameters(initial, compute)
        for model in {id(policy): policy, id(initial): initial}.values():
            install_attention(model, numerics=numerics, packed=cfg.shared_prompt != "padded")
        ref = copy.deepcopy(initial).eval().requires_grad_(False) if reference and not lora.on else None
        old = copy.deepcopy(policy).eval().requires_grad_(False) if snapshot else None
        ep_mesh = None
        if cfg.ep > 1:
            from tidal.modeling.parallel.ep import expert_mesh

            ep_mesh = expert_mesh(env.ranks, ep=cfg.ep, device_type=env.device.type, parent=env.group)
        lay_out([(policy, False), (ref, True), (old, True)] + ([(master, True)] if master is not policy else []),
                mesh=mesh, cfg=cfg, ep_mesh=ep_mesh)
        out = cls(policy, old, ref, mesh, load_tokenizer(model_path), cfg, temperature, env.device, master,
                  ep_mesh=ep_mesh, base_reference=reference and lora.on, model_path=model_path, cp=cp)
        for model in (policy, ref, old):  # all three route alike: with replay, the generator's experts
            routing = moe.install(model) if model is not None else None
            if routing is not None:
                routing.mode = "replay" if cfg.routing_replay else "compare"
                out.moe_shape = routing.shape
        if cp is not None and out.moe_shape is not None:
            raise ValueError(f"trainer.cp={cfg.cp} with a mixture-of-experts model: a split row's recorded routing is "
                             f"not built; set trainer.cp=1")
        return out

    # ---- a step, as the trainer runs it (tidal/executors/trainer/interface.py) ------------------------
    def begin_step(self, timeline) -> None:
        self.snapshot_()

    computes_loss = True  # every rank holds the whole model: each runs the loss

    def run(self, mb, micro_step, *, after_backward, old: bool = False):
        """Each micro-step runs whole, its backward included: nothing is deferred, so nothing is in
        flight at a group's end or before the optimizer step."""
        return micro_step()

    def end_of_group(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def step_figures(self) -> dict:
        return {}

    @property
    def sums_over(self) -> tuple:
        return (self.dp_group,)

    @property
    def push_dtype(self) -> torch.dtype:
        """The dtype the generator runs in: the compute dtype (weights are cast once, here)."""
        return PRECISIONS[self.cfg.precision] or next(self.policy.parameters()).dtype

    def _pushed(self, name: str) -> bool:
        """What the generator needs each step: every parameter, or with LoRA the adapters alone."""
        from tidal.modeling.lora import is_adapter

        return not self.cfg.lora.on or is_adapter(name)

    def shards(self) -> dict[str, torch.Tensor]:
        """This rank's local shard of every pushed policy parameter, in the generator's dtype (FSDP's
        sharded bf16 master weights are cast here, once per push)."""
        return {name: t.to(self.push_dtype) for name, t in local_shards(self.policy).items() if self._pushed(name)}

    def routing_counts(self) -> tuple[int, int]:
        """(tokens with a recorded routing, those whose own top-k differed) in the policy's last forward."""
        routing = moe.routing_of(self.policy)
        return routing.take() if routing is not None else (0, 0)

    def expert_params(self) -> list[bool] | None:
        """Per trainable parameter, whether it is split over ep (its gradient sums over the "edp"
        replicas only); None without expert parallel."""
        if self.ep_mesh is None:
            return None
        from tidal.modeling.parallel.ep import is_expert

        return is_expert(self.policy)

    @functools.cached_property
    def specs(self):
        """The policy's parameter layout, for the WEIGHTS channel's plan."""
        return {name: dataclasses.replace(spec, dtype=self.push_dtype) for name, spec in param_specs(self.policy).items()
                if self._pushed(name)}

    def snapshot_(self) -> None:
        """old <- policy: the weights that generate this step's samples (shard by shard)."""
        if self.old is not None:
            copy_params_(self.old, self.policy)

    def shares_prompt(self, group: ScoredGroup) -> bool:
        return shares_prompt(self.cfg, group.prompt_ids, group.responses)

    # ---- log-probs ----------------------------------------------------------------------------
    def _forward(self, model, mb, *, entropy: Entropy = False):
        """ResponseLogprobs of `model` on `mb` (a backend's one way of running its models)."""
        if self.cp is not None:
            return cp_forward(mb, model, cp=self.cp, temperature=self.temperature, chunk=self.cfg.logprob_chunk,
                              entropy=entropy)
        return mb.forward(model, temperature=self.temperature, chunk=self.cfg.logprob_chunk, entropy=entropy)

    def policy_logprobs(self, mb, *, entropy: Entropy = False):
        """ResponseLogprobs of the policy (with the token entropy when asked)."""
        return self._forward(self.policy, mb, entropy=entropy)

    def _logprobs(self, model, mb) -> torch.Tensor:
        return self._forward(model, mb).logp_NT

    def old_logprobs(self, mb, *, policy_NT: torch.Tensor, first_pass: bool) -> torch.Tensor:
        if first_pass or self.old is None:  # the policy IS the old policy until the batch's first optimizer step
            return policy_NT.detach()
        with torch.no_grad():
            return self._logprobs(self.old, mb)

    def ref_logprobs(self, mbs: list, *, pad_to: int) -> list:
        """Reference log-probs per micro-batch (None without a reference), then lockstep dummies."""
        if self.base_reference:
            from tidal.modeling.lora import adapters_disabled

            with adapters_disabled(self.policy):
                return frozen_logprobs(self.policy, mbs, pad_to=pad_to, dummy=self.dummy, logprobs=self._logprobs)
        return frozen_logprobs(self.reference, mbs, pad_to=pad_to, dummy=self.dummy, logprobs=self._logprobs)

    # ---- outputs ------------------------------------------------------------------------------
    def save(self, path, *, leader: bool) -> None:
        """The full policy (its master weights) as an HF directory; with LoRA its adapters in PEFT's format."""
        if not self.cfg.lora.on:
            return save_full(self.master, self.tokenizer, path, leader=leader)
        if leader:  # dp replicas hold the same adapters (LoRA runs without tp and FSDP)
            from tidal.modeling.lora import save_adapter

            save_adapter(self.master, self.cfg.lora, Path(path), base=self.model_path)
            self.tokenizer.save_pretrained(path)

    def finalize(self, path, *, leader: bool) -> None:
        """final/: what `save` writes, and with trainer.lora.merged the merged model in final/merged."""
        self.save(path, leader=leader)
        if self.cfg.lora.on and self.cfg.lora.merged and leader:
            from tidal.modeling.hf import save_hf
            from tidal.modeling.lora import merged_state

            save_hf(self.master, self.tokenizer, Path(path) / "merged", state=merged_state(self.master))
