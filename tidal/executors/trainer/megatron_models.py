"""The tri-model on megatron-core (trainer.backend=megatron): policy, old policy and reference as
GPTModels in one tensor-parallel layout, with the torch backend's interface (tidal/executors/trainer/models.py).

- Layout: the trainer's ("dp", "tp") mesh; its tp and dp groups are megatron's (tidal/modeling/megatron/groups.py), so the
  trainer's ranks alone hold megatron's groups in a split world.
- Weights: the HF checkpoint, converted and cut to this rank's tp part (tidal/modeling/megatron/convert.py). The old policy
  and the reference are GPTModels of their own with the same weights (a GPTModel holds its process
  groups, which copy.deepcopy cannot copy).
- Gradients go to the trainer's own order-independent accumulators, and one AdamW steps them
  (tidal/modeling/optim.py), sharded over dp (ZeRO-1) when dp > 1. q/k-norm gradients are
  partial sums per tp rank and are summed over tp at the barrier (convert.TP_PARTIAL_GRADS).
- Push: each rank converts its own megatron part to HF names locally (a tp part of the fused qkv
  holds whole query groups, of fc1 [its gate rows; its up rows]), so the WEIGHTS channel sees the
  torch backend's shards and specs: no gather.
- Save: the tp parts are gathered one tensor at a time and written as an HF directory.
- Pipeline stages (trainer.pp): the mesh is ("dp", "pp", "tp"); each stage's GPTModels hold its layers
  (tidal/modeling/megatron/stages.py), micro-batches go through the stages by tidal/modeling/megatron/pipeline.py's
  schedule (`run`, and the reference's forward in `ref_logprobs`), each stage pushes and saves
  its own layers.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tidal.executors.base import ExecutorEnv
from tidal.modeling.hf import load_model, load_tokenizer, save_hf
from tidal.modeling.megatron.convert import TP_PARTIAL_GRADS, Layout, to_hf, unshard
from tidal.modeling.megatron.forward import hidden_shape, install_packed_attention, response_logprobs, stage_hidden
from tidal.modeling.megatron.stages import global_names
from tidal.modeling.optim import GradLayout, Reduction
from tidal.modeling.parallel import apply_ac, param_specs
from tidal.executors.trainer.models import TriModel
from tidal.executors.learner.config import LearnerConfig
from tidal.executors.learner.models import PRECISIONS, learner_mesh


def _local_layout(lay: Layout, tp: int) -> Layout:
    """The layout of one tp rank's part: its heads and query groups."""
    return dataclasses.replace(lay, heads=lay.heads // tp, groups=lay.groups // tp)


@dataclass
class MegatronTriModel(TriModel):
    """TriModel's interface and semantics (old_logprobs, snapshot_, push_dtype, ...), megatron's models."""

    hf_config: object
    hf_specs: dict  # the HF model's ParamSpecs: what the generator describes its own model with
    pipeline: object = None  # tidal/modeling/megatron/pipeline.py Pipeline with trainer.pp > 1
    tied_group: object = None  # pp > 1, a tied embedding: this rank's first and last stages (stages.py)

    @classmethod
    def build(cls, *, model_path: str | None, dtype: torch.dtype, env: ExecutorEnv, cfg: LearnerConfig,
              temperature: float, reference: bool, snapshot: bool, policy_path=None,
              numerics: str = "default") -> "MegatronTriModel":
        assert numerics == "default", "model.numerics=exact is refused for the megatron backend (tidal/recipes/checks.py)"
        from tidal.modeling.megatron import model as meg, shims

        if not dist.is_initialized():
            raise ValueError("trainer.backend=megatron runs under torch.distributed (launch.py / torchrun)")
        if env.device.type == "cpu":
            shims.apply()
        _adapt_for_ascend(env.device)
        pp = cfg.pp
        mesh, stage, groups = _mesh(env, cfg)
        tp_rank = mesh.get_local_rank("tp")
        shims.seed_tracker(env.seed)
        hf = load_model(str(policy_path) if policy_path else model_path, dtype=dtype, seed=env.seed)
        config = hf.config
        tied_group = None
        if pp > 1 and Layout.of(config).tied and stage in (0, pp - 1):  # made last: middle stages make none
            ends = dist.get_process_group_ranks(mesh.get_group("pp"))
            tied_group = dist.new_group([ends[0], ends[-1]], use_local_synchronization=True)

        def built(state: dict, *, train: bool, to: torch.dtype | None = None) -> nn.Module:
            model = meg.build(config, tp=cfg.tp, pp=pp, stage=stage, groups=groups, parallel_output=True,
                              dtype=to or torch.float32)
            meg.load_hf(model, state, config, tp=cfg.tp, rank=tp_rank, pp=pp, stage=stage)
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
        pipeline = _pipeline(mesh=mesh, stage=stage, cfg=cfg) if pp > 1 else None
        return cls(policy, old, ref, mesh, load_tokenizer(model_path), cfg, temperature, env.device, master,
                   config, param_specs(hf), pipeline=pipeline, tied_group=tied_group)

    # ---- what the trainer's optimizer and push need ----------------------------------------------
    @property
    def layout(self) -> Layout:
        return Layout.of(self.hf_config)

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("tp")

    def grad_layout(self) -> GradLayout:
        """The gradients' sums: over dp; a tied embedding's two copies over the first and last stages, so
        both take the same step; q/k norms' partial sums over tp (convert.TP_PARTIAL_GRADS). The norm counts
        a plain tensor once per holder: the ranks of its stage, fewer if tp cuts it, twice for tied copies.
        AdamW sharded over dp (ZeRO-1), kept per rank: plain tp-cut tensors carry no global layout for dcp."""
        trainable = [(n, p) for n, p in self.master.named_parameters() if p.requires_grad]
        tied = [self.tied_group is not None and n in _TIED for n, _ in trainable]
        tp, dp = self.mesh["tp"].size(), self.mesh["dp"].size()
        reductions = [Reduction(self.dp_group)]
        if any(tied):
            reductions.append(Reduction(self.tied_group, which=tied))
        partial = [n.endswith(TP_PARTIAL_GRADS) for n, _ in trainable]
        if any(partial):
            reductions.append(Reduction(self.tp_group, which=partial))
        held_by = [dp * tp * (2 if t else 1) // (tp if getattr(p, "tensor_model_parallel", False) else 1)
                   for (_, p), t in zip(trainable, tied)]
        layout = {"ranks": self.mesh.size(), "dp": dp, "tp": tp} | ({"pp": self.cfg.pp} if self.pipeline else {})
        return GradLayout(reductions=tuple(reductions), mesh=self.mesh, held_by=held_by, zero_group=self.dp_group,
                          saved_layout=layout)

    @property
    def stage(self) -> int:
        return self.pipeline.stage if self.pipeline is not None else 0

    def _global(self, local: dict) -> dict:
        """This stage's megatron names -> the whole model's."""
        return global_names(local, layers=self.layout.layers, pp=self.cfg.pp, stage=self.stage, tied=self.layout.tied)

    def shards(self) -> dict[str, torch.Tensor]:
        """This rank's tp part of every HF parameter its stage holds, converted locally, in the generator's dtype."""
        mine = self._global({name: p.detach() for name, p in self.policy.named_parameters()})
        hf = to_hf(mine, _local_layout(self.layout, self.cfg.tp))
        return {name: hf[name].to(self.push_dtype) for name in self.hf_specs if name in hf}

    # ---- pipeline stages (trainer.pp > 1) -----------------------------------------------------
    def _received(self, mb, *, grad: bool) -> torch.Tensor | None:
        return self.pipeline.receive(hidden_shape(mb, self.hf_config.hidden_size), dtype=self.push_dtype,
                                     device=self.device, grad=grad)

    def begin_step(self, timeline) -> None:
        super().begin_step(timeline)
        if self.pipeline is not None:  # its waits go into this step's timeline and bubble
            self.pipeline.timeline = timeline
            self.pipeline.reset_clock()

    @property
    def computes_loss(self) -> bool:
        return self.pipeline is None or self.pipeline.last

    def step_figures(self) -> dict:
        """pipeline_bubble: the share of the step's pipeline work (later passes included) spent waiting."""
        return {"pipeline_bubble": self.pipeline.bubble()} if self.pipeline is not None else {}

    @property
    def sums_over(self) -> tuple:
        """A unit's stages first (the loss and its statistics are the last stage's alone), then dp."""
        return ((self.pipeline.group,) if self.pipeline is not None else ()) + (self.dp_group,)

    def run(self, mb, micro_step, *, after_backward, old: bool = False):
        """One training micro-batch through this stage: on the last stage `micro_step()` (log-probs, loss,
        backward) and its result; before it, the stage's forward, whose backward runs when the next stage
        sends its gradient (then `after_backward()`): None.
        old: the old policy's forward goes along (later mini-batches and epochs: its log-probs are the
        ratio's denominator), its hidden states after the policy's on each link."""
        if self.pipeline is None:
            return micro_step()
        pipe, old = self.pipeline, old and self.old is not None
        with pipe.timed():
            x = self._received(mb, grad=True)
            self.policy.set_input_tensor(x)
            if old:
                self.old.set_input_tensor(self._received(mb, grad=False))
            if pipe.last:
                out = micro_step()
                pipe.backward_done(x)
                return out
            y = stage_hidden(self.policy, mb)
            with torch.no_grad():
                also = [stage_hidden(self.old, mb)] if old else []
            pipe.forwarded(x, y, after_backward=after_backward, also=also)
            return None

    def ref_logprobs(self, mbs: list, *, pad_to: int) -> list:
        if self.pipeline is None or self.reference is None:
            return super().ref_logprobs(mbs, pad_to=pad_to)
        pipe, out = self.pipeline, []
        with pipe.timed(), torch.no_grad():  # forward only: through the stages ahead of the group's training
            for mb in mbs:
                self.reference.set_input_tensor(self._received(mb, grad=False))
                if pipe.last:
                    out.append(self._logprobs(self.reference, mb))
                else:
                    pipe.send(stage_hidden(self.reference, mb))
                    out.append(None)
        return out

    def end_of_group(self) -> None:
        if self.pipeline is not None:
            with self.pipeline.timed():
                self.pipeline.end_of_group()

    def drain(self) -> None:
        if self.pipeline is not None:
            with self.pipeline.timed():
                self.pipeline.drain()

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
        tp, full, first = self.cfg.tp, {}, self.mesh.get_local_rank("tp") == 0
        for name, p in self.master.named_parameters():
            parts = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(parts, p.detach().contiguous(), group=self.tp_group)
            if first:
                full.update(unshard([{name: t.cpu()} for t in parts], self.layout))
        if self.pipeline is not None:  # each stage's first tp rank hands its layers to the first stage's
            if not first:
                return
            stages = [None] * self.cfg.pp if self.stage == 0 else None
            dist.gather_object(self._global(full), stages, dst=dist.get_process_group_ranks(self.pipeline.group)[0],
                               group=self.pipeline.group)
            full = {k: v for part in stages or () for k, v in part.items()}
        if leader:
            hf = to_hf(full, self.layout)
            with torch.device("meta"):
                skeleton = transformers.AutoModelForCausalLM.from_config(self.hf_config)
            state = {name: hf[name].contiguous() for name in self.hf_specs}
            save_hf(skeleton, self.tokenizer, path, state=state)


_TIED = ("embedding.word_embeddings.weight", "output_layer.weight")  # with pp > 1 and tied embeddings


def _mesh(env: ExecutorEnv, cfg: LearnerConfig) -> tuple:
    """The trainer's mesh (a pp dimension with trainer.pp > 1), this rank's stage and megatron's process
    groups; made in the same order on every rank."""
    from tidal.modeling.megatron.groups import process_groups

    if cfg.pp > 1:
        from tidal.modeling.parallel.mesh import build_pipeline_mesh

        mesh = build_pipeline_mesh(ranks=env.ranks, tp=cfg.tp, pp=cfg.pp, device_type=env.device.type, parent=env.group)
    else:
        mesh = learner_mesh(env, cfg)
    me = dist.new_group([env.rank], use_local_synchronization=True)  # context parallel: size 1
    stage = mesh.get_local_rank("pp") if cfg.pp > 1 else 0
    groups = process_groups(tp=mesh.get_group("tp"), dp=mesh.get_group("dp"), single=me,
                            pp=mesh.get_group("pp") if cfg.pp > 1 else None)
    return mesh, stage, groups


def _pipeline(*, mesh, stage: int, cfg: LearnerConfig):
    from tidal.modeling.megatron.pipeline import Pipeline

    return Pipeline(group=mesh.get_group("pp"), stage=stage, stages=cfg.pp, drain_every_group=cfg.pp_drain == "group")


def _adapt_for_ascend(device: torch.device) -> None:
    """On Ascend, MindSpeed patches megatron-core with its NPU kernels when imported, before any
    model is built; it ships with Ascend's own distribution (the `mindspeed` on PyPI is a placeholder)."""
    if device.type != "npu":
        return
    try:
        import mindspeed.megatron_adaptor  # noqa: F401
    except ImportError:
        pass  # megatron-core's own layers run on torch_npu too, without MindSpeed's fused kernels
