"""Which pipeline stage holds what (trainer.pp): the decoder layers cut into pp equal runs, the
embedding on the first stage, the final norm and the LM head on the last.

Pure functions of names, so every rank (the trainer's stages, the generator building the same push
plan, the planner) answers alike without communication. A tied model's LM head is the embedding:
the last stage holds a copy of it (megatron's `output_layer.weight` there), the first stage's is the
one pushed and saved, and the two copies' gradients are summed at the barrier so they stay equal.
Which stage holds a layer, the embedding or the head is one rule, tidal/channels/payloads.py `stage_of`,
which the push plan asks too (`hf_stage`).
"""
from __future__ import annotations

import re

from tidal.channels.payloads import stage_of

_MEG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def check_stages(*, layers: int, pp: int) -> None:
    if pp < 1 or layers % pp:
        raise ValueError(f"trainer.pp={pp} must divide the model's {layers} decoder layers "
                         f"(each stage holds layers/pp of them)")


def stage_layers(*, layers: int, pp: int, stage: int) -> range:
    """The global indices of the decoder layers stage `stage` holds (a run: `stage_of` is monotone)."""
    check_stages(layers=layers, pp=pp)
    mine = [i for i in range(layers) if stage_of(layer=i, layers=layers, pp=pp) == stage]
    return range(mine[0], mine[-1] + 1)


def stage_part(meg: dict, *, layers: int, pp: int, stage: int, tied: bool) -> dict:
    """A full (or tp-sharded) megatron state dict cut to stage `stage`'s part, its layers renumbered
    from 0 as megatron's decoder holds them locally."""
    if pp == 1:
        return dict(meg)
    mine, out = stage_layers(layers=layers, pp=pp, stage=stage), {}
    for name, t in meg.items():
        m = _MEG_LAYER.match(name)
        if m is not None:
            i = int(m.group(1))
            if i in mine:
                out[f"decoder.layers.{i - mine.start}." + name[m.end():]] = t
        elif stage_of(layer=None, embedding=name.startswith("embedding."), layers=layers, pp=pp) == stage:
            out[name] = t  # the embedding; the final norm and output layer
    if tied and stage == pp - 1:  # the head's own copy of the embedding (see the module docstring)
        out["output_layer.weight"] = meg["embedding.word_embeddings.weight"]
    return out


def global_names(local: dict, *, layers: int, pp: int, stage: int, tied: bool) -> dict:
    """Stage `stage`'s local megatron names -> the whole model's (layers renumbered back); the last
    stage's copy of a tied embedding is dropped (the first stage's is the one)."""
    if pp == 1:
        return dict(local)
    first = stage_layers(layers=layers, pp=pp, stage=stage).start
    out = {}
    for name, t in local.items():
        if tied and name == "output_layer.weight":
            continue
        m = _MEG_LAYER.match(name)
        out[f"decoder.layers.{int(m.group(1)) + first}." + name[m.end():] if m else name] = t
    return out
