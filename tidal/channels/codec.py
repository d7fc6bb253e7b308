"""Typed payloads <-> (small JSON header, one flat byte body).

A payload is a dataclass. Fields annotated `torch.Tensor` travel as raw bytes, fields annotated
`list[torch.Tensor]` are ragged (1-D tensors of one dtype: flattened + lengths), everything else
must be JSON-serialisable and travels in the header. One body per item means one p2p message.
`torch.Tensor | None` and `list[torch.Tensor] | None` (or `Optional[...]`) may hold None, which
travels in the header. A payload may subclass another (extra fields); `encode(item, as_type)`
sends only `as_type`'s fields, so a subclass item on a channel of its base arrives as the base.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from functools import lru_cache

import torch

_ALIGN = 8  # so `view(dtype)` of a body slice is always legal


def _hints(cls: type) -> dict:
    """Field name -> resolved annotation, for `cls` and its bases."""
    try:
        return typing.get_type_hints(cls)
    except NameError as e:  # e.g. torch imported only for type checkers, or a function-local alias
        raise TypeError(f"payload {cls.__name__}: cannot resolve its field annotations ({e}); annotate "
                        f"tensors as torch.Tensor or list[torch.Tensor] with torch imported at module level") from None


def _kind(hint) -> str:
    if hint is torch.Tensor:
        return "tensor"
    if typing.get_origin(hint) is list and typing.get_args(hint) == (torch.Tensor,):
        return "ragged"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2 and _kind(rest[0]) in ("tensor", "ragged"):
            return _kind(rest[0]) + "?"
    return "plain"


@lru_cache(maxsize=None)
def field_kinds(cls: type) -> dict[str, str]:
    """Field name -> 'tensor' | 'ragged' | 'plain', or 'tensor?' | 'ragged?' for `... | None` fields.

    Raises TypeError for non-dataclasses and for tensor annotations that cannot be resolved.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"payload type {cls.__name__} must be a dataclass")
    hints = _hints(cls)
    return {f.name: _kind(hints[f.name]) for f in dataclasses.fields(cls)}


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def encode(item, as_type: type | None = None) -> tuple[dict, torch.Tensor]:
    """`as_type` (a class `item` is an instance of; default its own): encode that type's fields only."""
    cls = type(item) if as_type is None else as_type
    if not isinstance(item, cls):
        raise TypeError(f"cannot encode a {type(item).__name__} as {cls.__name__}")
    kinds = field_kinds(cls)
    header: dict = {"plain": {}, "tensors": []}
    chunks: list[torch.Tensor] = []
    offset = 0
    for name, kind in kinds.items():
        value = getattr(item, name)
        if kind == "plain" or (value is None and kind.endswith("?")):
            header["plain"][name] = value
            continue
        if value is None:
            raise TypeError(f"{cls.__name__}.{name} is None, but is annotated as a {kind} field "
                            f"(annotate it `... | None` to allow None)")
        kind = kind.removesuffix("?")
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
    try:  # fail here, at the sender, if a plain field is not JSON-serialisable
        json.dumps(header)
    except (TypeError, ValueError) as e:
        bad = [n for n, v in header["plain"].items() if not _jsonable(v)]
        raise TypeError(f"{cls.__name__}: plain field(s) {bad} are not JSON-serialisable ({e})") from None
    return header, body


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def decode(cls: type, header: dict, body: torch.Tensor):
    values = dict(header["plain"])
    for name, dtype, shape, offset, lengths in header["tensors"]:
        dt = getattr(torch, dtype)
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size()
        flat = body[offset : offset + nbytes].view(dt).reshape(shape)
        values[name] = list(flat.split(lengths)) if lengths is not None else flat
    no_init = {f.name for f in dataclasses.fields(cls) if not f.init}
    item = cls(**{k: v for k, v in values.items() if k not in no_init})
    for name in no_init & values.keys():
        object.__setattr__(item, name, values[name])
    return item
