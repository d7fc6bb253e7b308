"""Typed payloads <-> (small JSON header, one flat byte body).

A payload is a dataclass. Fields annotated `torch.Tensor` travel as raw bytes, fields annotated
`list[torch.Tensor]` are ragged (1-D tensors of one dtype: flattened + lengths), everything else
must be JSON-serialisable and travels in the header. One body per item means one p2p message.
"""
from __future__ import annotations

import dataclasses
import json
import typing
from functools import lru_cache

import torch

_ALIGN = 8  # so `view(dtype)` of a body slice is always legal


@lru_cache(maxsize=None)
def field_kinds(cls: type) -> dict[str, str]:
    """Field name -> 'tensor' | 'ragged' | 'plain'. Raises TypeError for non-dataclasses."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"payload type {cls.__name__} must be a dataclass")
    hints = typing.get_type_hints(cls)
    kinds = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if hint is torch.Tensor:
            kinds[f.name] = "tensor"
        elif typing.get_origin(hint) is list and typing.get_args(hint) == (torch.Tensor,):
            kinds[f.name] = "ragged"
        else:
            kinds[f.name] = "plain"
    return kinds


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def encode(item) -> tuple[dict, torch.Tensor]:
    kinds = field_kinds(type(item))
    header: dict = {"plain": {}, "tensors": []}
    chunks: list[torch.Tensor] = []
    offset = 0
    for name, kind in kinds.items():
        value = getattr(item, name)
        if kind == "plain":
            header["plain"][name] = value
            continue
        if kind == "ragged":
            dtypes = {t.dtype for t in value}
            if len(dtypes) > 1:
                raise TypeError(f"ragged field {name!r} mixes dtypes {sorted(map(str, dtypes))}")
            lengths = [t.numel() for t in value]
            flat = torch.cat([t.reshape(-1) for t in value]) if value else torch.empty(0)
            entry = [name, _dtype_name(flat), [flat.numel()], offset, lengths]
        else:
            flat = value
            entry = [name, _dtype_name(flat), list(flat.shape), offset, None]
        raw = flat.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        pad = -raw.numel() % _ALIGN
        chunks.append(raw)
        if pad:
            chunks.append(torch.zeros(pad, dtype=torch.uint8))
        header["tensors"].append(entry)
        offset += raw.numel() + pad
    body = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    json.dumps(header)  # fail here, at the sender, if a plain field is not JSON-serialisable
    return header, body


def decode(cls: type, header: dict, body: torch.Tensor):
    values = dict(header["plain"])
    for name, dtype, shape, offset, lengths in header["tensors"]:
        dt = getattr(torch, dtype)
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size()
        flat = body[offset : offset + nbytes].view(dt).reshape(shape)
        values[name] = list(flat.split(lengths)) if lengths is not None else flat
    return cls(**values)
