"""Trainer (Hugging Face) parameter names -> where a generator engine keeps them (tests/test_reshard.py:
a push landing straight in vLLM-style stacked tensors; no engine receives this way yet, docs/status.md).

A push plan speaks trainer names and tp-local boxes. On the generator side each trainer parameter
lands in a `Slot`: an engine tensor and the row (dim 0) where that parameter's tp-local block
starts inside this rank's shard of it. `targets` turns those into what `WeightPush.run` takes on a
generator rank: {trainer name: that row block of the engine tensor}, a view written through.

- `IDENTITY`: the native engine runs the same HF model class; names and shards are the same.
- `FUSED`: engines that stack projections (vLLM's qkv_proj and gate_up_proj). Each tp rank's shard
  of a stacked tensor is its own q rows, then k rows, then v rows (gate, then up), so a stacked
  member must be split by output rows (tp_dim 0) and evenly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from tidal.channels.payloads import ParamSpec, local_shape


@dataclass(frozen=True)
class Slot:
    """Where a trainer parameter lands on a generator rank."""

    name: str  # engine tensor name
    row_offset: int  # first row of this parameter's tp-local block in that tensor's local shard


class Identity:
    def slots(self, specs: Mapping[str, ParamSpec], *, tp: int) -> dict[str, Slot]:
        return {name: Slot(name, 0) for name in specs}

    def engine_shapes(self, specs: Mapping[str, ParamSpec], *, tp: int, rank: int = 0) -> dict[str, tuple[int, ...]]:
        return {name: local_shape(spec, tp=tp, rank=rank) for name, spec in specs.items()}


class Stacked:
    """Projections stacked by output rows into one engine tensor per group."""

    def __init__(self, groups: Mapping[str, tuple[str, ...]]):
        self.groups = dict(groups)  # engine module name -> member module names, in row order
        self.member_of = {m: (fused, i) for fused, members in groups.items() for i, m in enumerate(members)}

    def _split(self, name: str) -> tuple[str, str, str] | None:
        """'model.layers.0.self_attn.q_proj.weight' -> ('model.layers.0.self_attn', 'q_proj', 'weight')."""
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self.member_of:
            return ".".join(parts[:-2]), parts[-2], parts[-1]
        return None

    def slots(self, specs: Mapping[str, ParamSpec], *, tp: int) -> dict[str, Slot]:
        out = {}
        for name, spec in specs.items():
            split = self._split(name)
            if split is None:
                out[name] = Slot(name, 0)
                continue
            prefix, member, leaf = split
            fused, index = self.member_of[member]
            offset = 0
            for sibling in self.groups[fused][:index]:
                offset += self._rows(specs, f"{prefix}.{sibling}.{leaf}", tp=tp)
            self._rows(specs, name, tp=tp)  # validates this member too
            out[name] = Slot(f"{prefix}.{fused}.{leaf}", offset)
        return out

    def engine_shapes(self, specs: Mapping[str, ParamSpec], *, tp: int, rank: int = 0) -> dict[str, tuple[int, ...]]:
        slots = self.slots(specs, tp=tp)
        out: dict[str, tuple[int, ...]] = {}
        for name, spec in specs.items():
            slot, shape = slots[name], local_shape(spec, tp=tp, rank=rank)
            end = (slot.row_offset + shape[0], *shape[1:])
            prev = out.get(slot.name)
            assert prev is None or prev[1:] == end[1:], f"stacked members of {slot.name} differ in shape"
            out[slot.name] = end if prev is None else (max(prev[0], end[0]), *end[1:])
        return out

    @staticmethod
    def _rows(specs: Mapping[str, ParamSpec], name: str, *, tp: int) -> int:
        if name not in specs:
            raise ValueError(f"stacking needs {name!r}, which the model does not have")
        spec = specs[name]
        if spec.tp_dim != 0 or spec.shape[0] % tp:
            raise ValueError(f"{name!r} (shape {spec.shape}, tp_dim {spec.tp_dim}) cannot be stacked at tp={tp}: "
                             f"stacked members must be split evenly by output rows")
        return spec.shape[0] // tp


IDENTITY = Identity()
# vLLM's stacked parameters for Llama / Qwen2 / Qwen3
FUSED = Stacked({"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")})


def targets(names: Identity | Stacked, engine: Mapping[str, torch.Tensor], specs: Mapping[str, ParamSpec], *,
            tp: int, rank: int) -> dict[str, torch.Tensor]:
    """{trainer name: its tp-local block inside generator tp rank `rank`'s engine tensors} (views)."""
    slots = names.slots(specs, tp=tp)
    out = {}
    for name, spec in specs.items():
        slot, rows = slots[name], local_shape(spec, tp=tp, rank=rank)[0]
        out[name] = engine[slot.name][slot.row_offset: slot.row_offset + rows]
    return out
