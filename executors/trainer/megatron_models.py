"""The tri-model on megatron-core (trainer.backend=megatron): policy, old policy and reference as
GPTModels in one tensor-parallel layout, with the torch backend's interface (executors/trainer/models.py).

- Layout: the trainer's ("dp", "tp") mesh; its tp and dp groups are megatron's (modeling/megatron/groups.py), so the
  trainer's ranks alone hold megatron's groups in a split world.
- Weights: the HF checkpoint, converted and cut to this rank's tp part (modeling/megatron/convert.py). The old policy
  and the reference are GPTModels of their own with the same weights (a GPTModel holds its process
  groups, which copy.deepcopy cannot copy).
- Gradients go to the trainer's own order-independent accumulators, and one AdamW steps them
  (modeling/optim.py), sharded over dp (ZeRO-1) when dp > 1. q/k-norm gradients are
  partial sums per tp rank and are summed over tp at the barrier (convert.TP_PARTIAL_GRADS).
- Push: each rank converts its own megatron part to HF names locally (a tp part of the fused qkv
  holds whole query groups, of fc1 [its gate rows; its up rows]), so the WEIGHTS channel sees the
  torch backend's shards and specs: no gather.
- Save: the tp parts are gathered one tensor at a time and written as an HF directory.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from executors.base import ExecutorEnv
from modeling.hf import load_model, load_tokenizer, save_hf
from modeling.megatron.convert import TP_PARTIAL_GRADS, Layout, to_hf, unshard
from modeling.megatron.forward import install_packed_attention, response_logprobs
from modeling.parallel import apply_ac, param_specs
from executors.trainer.models import TriModel
from executors.learner.config import LearnerConfig
from executors.learner.models import PRECISIONS, learner_mesh


def _local_layout(lay: Layout, tp: int) -> Layout:
    """The layout of one tp rank's part: its heads and query groups."""
    return dataclasses.replace(lay, heads=lay.heads // tp, groups=lay.groups // tp)


@dataclass
class MegatronTriModel(TriModel):
    """TriModel's interface and semantics (old_logprobs, snapshot_, push_dtype, ...), megatron's models."""

    hf_config: object
    hf_specs: dict  # the HF model's ParamSpecs: what the generator describes its own model with

    @classmethod
    def build(cls, *, model_path: str | None, dtype: torch.dtype, env: ExecutorEnv, cfg: LearnerConfig,
              temperature: float, reference: bool, snapshot: bool, policy_path=None,
              numerics: str = "default") -> "MegatronTriModel":
        assert numerics == "default", "model.numerics=exact is refused for the megatron backend (recipes/checks.py)"
        from modeling.megatron import model as meg, shims
        from modeling.megatron.groups import process_groups

        if not dist.is_initialized():
            raise ValueError("trainer.backend=megatron runs under torch.distributed (launch.py / torchrun)")
        if env.device.type == "cpu":
            shims.apply()
        _adapt_for_ascend(env.device)
        mesh = learner_mesh(env, cfg)
        me = dist.new_group([env.rank], use_local_synchronization=True)  # context / pipeline parallel: size 1
        groups = process_groups(tp=mesh.get_group("tp"), dp=mesh.get_group("dp"), single=me)
        tp_rank = mesh.get_local_rank("tp")
        shims.seed_tracker(env.seed)
        hf = load_model(str(policy_path) if policy_path else model_path, dtype=dtype, seed=env.seed)
        config = hf.config

        def built(state: dict, *, train: bool, to: torch.dtype | None = None) -> nn.Module:
            model = meg.build(config, tp=cfg.tp, groups=groups, parallel_output=True, dtype=to or torch.float32)
            meg.load_hf(model, state, config, tp=cfg.tp, rank=tp_rank)
            install_packed_attention(model)
            model = model.to(env.device, dtype=to) if to is not None else model.to(env.device)
            return model.train() if train else model.eval().requires_grad_(False)

        compute = PRECISIONS[cfg.precision]
        weights = hf.state_dict()
        master = built(weights, train=True, to=dtype)
        policy = built(weights, train=True, to=compute) if compute is not None else master
        if cfg.activation_checkpointing:  # torch's checkpoint per megatron layer, as the torch backend's
            apply_ac(policy, layers=policy.decoder.layers)
        initial = weights if not (policy_path and reference) else load_model(model_path, dtype=dtype,
                                                                              seed=env.seed).state_dict()
        ref = built(initial, train=False, to=compute) if reference else None
        old = built(weights, train=False, to=compute) if snapshot else None
        return cls(policy, old, ref, mesh, load_tokenizer(model_path), cfg, temperature, env.device, master,
                   config, param_specs(hf))

    # ---- what the trainer's optimizer and push need ----------------------------------------------
    @property
    def layout(self) -> Layout:
        return Layout.of(self.hf_config)

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("tp")

    # plain tp-sharded tensors carry no global layout for dcp: AdamW's state is kept per rank (ZeRO-1 over dp)
    per_rank_optimizer = True

    def tp_partial(self) -> list[bool]:
        """Per trainable parameter of the policy, in parameters() order: is its gradient a partial sum over tp?"""
        return [n.endswith(TP_PARTIAL_GRADS) for n, p in self.policy.named_parameters() if p.requires_grad]

    def shards(self) -> dict[str, torch.Tensor]:
        """This rank's tp part of every HF parameter, converted locally, in the generator's dtype."""
        mine = {name: p.detach() for name, p in self.policy.named_parameters()}
        hf = to_hf(mine, _local_layout(self.layout, self.cfg.tp))
        return {name: hf[name].to(self.push_dtype) for name in self.hf_specs}

    @functools.cached_property
    def specs(self):
        return {name: dataclasses.replace(spec, dtype=self.push_dtype) for name, spec in self.hf_specs.items()}

    def _forward(self, model, mb, *, entropy: bool = False):
        return response_logprobs(model, mb, temperature=self.temperature, chunk=self.cfg.logprob_chunk,
                                 entropy=entropy)

    # ---- outputs ------------------------------------------------------------------------------
    @torch.no_grad()
    def save(self, path, *, leader: bool) -> None:
        """The full policy (its master weights) as an HF directory: tp parts gathered tensor by tensor,
        joined and converted on the leader."""
        import transformers

        if self.mesh.get_local_rank("dp") != 0:  # the other dp units hold the same weights: nothing to gather
            return
        tp, full = self.cfg.tp, {}
        for name, p in self.master.named_parameters():
            parts = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(parts, p.detach().contiguous(), group=self.tp_group)
            if leader:
                full.update(unshard([{name: t.cpu()} for t in parts], self.layout))
        if leader:
            hf = to_hf(full, self.layout)
            with torch.device("meta"):
                skeleton = transformers.AutoModelForCausalLM.from_config(self.hf_config)
            state = {name: hf[name].contiguous() for name in self.hf_specs}
            save_hf(skeleton, self.tokenizer, path, state=state)


def _adapt_for_ascend(device: torch.device) -> None:
    """On Ascend, MindSpeed patches megatron-core with its NPU kernels when imported, before any
    model is built; it ships with Ascend's own distribution (the `mindspeed` on PyPI is a placeholder)."""
    if device.type != "npu":
        return
    try:
        import mindspeed.megatron_adaptor  # noqa: F401
    except ImportError:
        pass  # megatron-core's own layers run on torch_npu too, without MindSpeed's fused kernels
