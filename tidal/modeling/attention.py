"""Which attention a model computes with: the one rule for the engine, the trainer's models and the critic's.

- model.numerics=exact: the batch-invariant attention (tidal/modeling/exact_attention.py), which takes packed
  rows itself, with the batch-invariant products (tidal/modeling/numerics.py `install`);
- packed rows (a learner whose shared_prompt is not `padded`): the block-mask attention over a packed row
  (tidal/modeling/packed_attention.py);
- else the model's own SDPA; the engine decodes through its slots' attention whatever the model's
  (tidal/modeling/slot_attention.py), so it asks for exact products alone.
Installed in place, before the old policy and the reference are copied from the model: they inherit it.
"""
from __future__ import annotations

from torch import nn

from tidal.modeling.exact_attention import ATTN_NAME as EXACT
from tidal.modeling.packed_attention import ATTN_NAME as PACKED
from tidal.modeling.packed_attention import install as install_packed


def install(model: nn.Module, *, numerics: str, packed: bool) -> None:
    """`model`'s attention (and under exact numerics its products) for a job's numerics and rows."""
    if numerics == "exact":
        from tidal.modeling.numerics import install as install_exact

        install_exact(model)
    elif packed:
        install_packed(model)


def for_packed_rows(model: nn.Module) -> None:
    """Before a packed forward: an attention that takes packed rows (idempotent; exact attention does already)."""
    if model.config._attn_implementation not in (PACKED, EXACT):
        install_packed(model)
