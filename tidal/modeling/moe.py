"""Mixture-of-experts models: which layers route, and routing replay.

A token's experts are the top-k of its router's scores. The engine that sampled a token and the
trainer that scores it compute those scores in different kernels and batch shapes, so near-ties can
fall the other way: the token then runs through other experts in the trainer, and its log-prob
differs by far more than float noise (docs/big-models.md, "Mixture of experts"). Replay removes that cause: the
generator records, per token and MoE layer, the expert ids it used; they travel with the group
(RolloutGroup.routing, one byte per id) and the trainer's routers take them instead of their own
top-k. The mixing weights are still the trainer's softmax at those ids, so the router trains.

Every router gets a forward hook (`install`) reading a `Routing` holder on the model:
- record: keep each layer's chosen ids (the generator);
- replay: use the given ids where one was recorded (`UNRECORDED` elsewhere: the last token of a
  response is never fed, and a lockstep dummy has none), and count the tokens whose own top-k
  would have differed: `routing_mismatch_frac`;
- compare (trainer.routing_replay=false): the same count, the router's own choice kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
from torch import nn

from tidal.common.registry import Registry


@dataclass(frozen=True)
class MoeFamily:
    sparse_layers: Callable[[object], list[int]]  # (HF config) -> indices of the decoder layers that route
    router: str  # the class name of its top-k router module (forward -> (logits, scores, indices))
    experts: str  # the class name of its experts module (3-D weights, experts on dim 0)


def _qwen3_moe_layers(config) -> list[int]:
    return [i for i in range(config.num_hidden_layers) if i not in config.mlp_only_layers
            and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0]


FAMILIES: Registry[MoeFamily] = Registry("mixture-of-experts model family")
FAMILIES.register("qwen3_moe", MoeFamily(_qwen3_moe_layers, router="Qwen3MoeTopKRouter", experts="Qwen3MoeExperts"))


@dataclass(frozen=True)
class MoeShape:
    experts: int
    top_k: int
    layers: tuple[int, ...]  # the decoder layers with a router

    @property
    def id_dtype(self) -> torch.dtype:
        """The compact dtype of a recorded expert id (UNRECORDED included)."""
        return torch.uint8 if self.experts < 255 else torch.int16


UNRECORDED = -1  # as stored: 255 in uint8


def moe_shape(config) -> MoeShape | None:
    """The model's experts and routed layers; None for a dense model."""
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return None
    return MoeShape(experts=config.num_experts, top_k=config.num_experts_per_tok,
                    layers=tuple(FAMILIES.get(family).sparse_layers(config)))


def parameter_counts(config) -> tuple[int, int] | None:
    """(expert parameters in all, of them those a token runs through) of an MoE config; None: dense."""
    shape = moe_shape(config)
    if shape is None:
        return None
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    return per_expert * shape.experts * len(shape.layers), per_expert * shape.top_k * len(shape.layers)


def check_ep(experts: int, *, ep: int) -> None:
    if experts % ep:
        raise ValueError(f"trainer.ep={ep} must divide the model's {experts} experts (each ep rank holds "
                         f"experts/ep of them)")


@dataclass
class Routing:
    """What a model's router hooks do, and what they saw (one per model copy)."""

    shape: MoeShape
    mode: Literal["off", "record", "replay", "compare"] = "off"
    given_NLk: torch.Tensor | None = None  # replay/compare: long ids [tokens, layers, k], UNRECORDED where none
    recorded: list[torch.Tensor] = field(default_factory=list)  # record: per routed layer, [tokens, k]
    differs_N: torch.Tensor | None = None  # replay/compare: the tokens whose own choice differed (any layer)

    def take(self) -> tuple[int, int]:
        """(tokens with a recorded routing, of them those whose own choice differed) of the last forward."""
        if self.given_NLk is None or self.differs_N is None:
            return 0, 0
        known_N = (self.given_NLk != UNRECORDED).all(dim=-1).any(dim=-1)
        return int(known_N.sum()), int((self.differs_N & known_N).sum())


class _RouterHook:
    def __init__(self, routing: Routing, layer: int, norm_topk: bool):
        self.routing, self.layer, self.norm_topk = routing, layer, norm_topk

    def __call__(self, module: nn.Module, args, output):
        r = self.routing
        logits_NE, scores_Nk, ids_Nk = output
        if r.mode == "record":
            r.recorded.append(ids_Nk.detach())
        if r.mode not in ("replay", "compare") or r.given_NLk is None:
            return None
        given_Nk = r.given_NLk[:, self.layer].to(ids_Nk.device)
        assert given_Nk.shape == ids_Nk.shape, (given_Nk.shape, ids_Nk.shape)
        known_N = (given_Nk != UNRECORDED).all(dim=-1)
        differs_N = known_N & (given_Nk.sort(dim=-1).values != ids_Nk.sort(dim=-1).values).any(dim=-1)
        r.differs_N = differs_N if r.differs_N is None else r.differs_N | differs_N
        if r.mode == "compare" or not bool(differs_N.any()):
            return None  # the same experts in the same order: the router's own output is the replay's, bit for bit
        # the router's own arithmetic (Qwen3MoeTopKRouter), at the given ids: the weights keep their gradient
        ids_Nk = torch.where(known_N[:, None], given_Nk, ids_Nk)
        top_Nk = torch.softmax(logits_NE, dtype=torch.float, dim=-1).gather(-1, ids_Nk)
        if self.norm_topk:
            top_Nk = top_Nk / top_Nk.sum(dim=-1, keepdim=True)
        return logits_NE, top_Nk.to(logits_NE.dtype), ids_Nk


def install(model: nn.Module) -> Routing | None:
    """Hook every router of an MoE model (once); the model's `Routing`, or None for a dense model."""
    if getattr(model, "_tidal_routing", None) is not None:
        return model._tidal_routing
    shape = moe_shape(model.config)
    if shape is None:
        return None
    family = FAMILIES.get(model.config.model_type)
    routers = [m for m in model.modules() if type(m).__name__ == family.router]
    assert len(routers) == len(shape.layers), (len(routers), shape.layers)
    routing = Routing(shape)
    for layer, router in enumerate(routers):  # modules() walks the layers in order
        router.register_forward_hook(_RouterHook(routing, layer, bool(getattr(router, "norm_topk_prob", False))))
    model._tidal_routing = routing
    return routing


def expert_modules(model: nn.Module) -> set[str]:
    """The names of an MoE model's experts modules (HF's, or their expert-parallel share): their
    weights have the experts on dim 0. Empty for a dense model."""
    family = getattr(model.config, "model_type", None)
    if family not in FAMILIES:
        return set()
    kinds = {FAMILIES.get(family).experts, "ExpertParallel"}
    return {name for name, m in model.named_modules() if type(m).__name__ in kinds}


def routing_of(model: nn.Module) -> Routing | None:
    return getattr(model, "_tidal_routing", None)


def set_given(model: nn.Module, given_NLk: torch.Tensor | None) -> None:
    """The ids the model's next forward replays (or compares with); None: its own choice, uncounted.
    Kept after the forward, so a backward that recomputes it (activation checkpointing) replays too."""
    routing = routing_of(model)
    if routing is not None and routing.mode in ("replay", "compare"):
        routing.given_NLk, routing.differs_N = given_NLk, None


# ---- the group's routing, as it travels (RolloutGroup.routing) ------------------------------------
def pack(prompt_PLk: torch.Tensor, responses: list[torch.Tensor], shape: MoeShape) -> list[torch.Tensor]:
    """[prompt, response_1..G] routing as the flat compact tensors a payload carries."""
    return [t.to(shape.id_dtype).reshape(-1) for t in (prompt_PLk, *responses)]


def unpack(flat: list[torch.Tensor], shape: MoeShape) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(prompt [P, L, k], G x [R_i, L, k]) long ids, UNRECORDED where none was recorded."""
    def one(t):
        ids = t.long()
        if shape.id_dtype == torch.uint8:
            ids[ids == 255] = UNRECORDED
        return ids.view(-1, len(shape.layers), shape.top_k)

    return one(flat[0]), [one(t) for t in flat[1:]]
