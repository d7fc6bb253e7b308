"""HF <-> megatron-core weights for the Qwen3, Qwen2 and Llama families (GPTModel, local layer spec).

    HF                                   megatron
    q_proj, k_proj, v_proj [+ biases]    linear_qkv: per query group g, [g's q heads; k_g; v_g]
    o_proj                               linear_proj
    gate_proj, up_proj                   linear_fc1: [gate; up]
    down_proj                            linear_fc2
    q_norm, k_norm (Qwen3)               q_layernorm, k_layernorm
    input_layernorm                      input_layernorm
    post_attention_layernorm             pre_mlp_layernorm
    embed_tokens, norm, lm_head          word_embeddings, final_layernorm, output_layer (untied only)

Pure reshapes and concatenations, so HF -> megatron -> HF is bit-exact. `shard` cuts a full
megatron state dict into one tensor-parallel rank's part, as megatron's parallel layers hold it;
`unshard` joins the parts again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FAMILIES = ("qwen3", "qwen2", "llama")


@dataclass(frozen=True)
class Layout:
    layers: int
    heads: int
    groups: int  # key/value heads
    head_dim: int
    qk_norm: bool
    qkv_bias: bool
    tied: bool

    @classmethod
    def of(cls, config) -> "Layout":
        kind = config.model_type
        if kind not in FAMILIES:
            raise ValueError(f"trainer.backend=megatron converts {', '.join(FAMILIES)} models; this one is {kind!r}")
        if kind == "llama" and (getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)):
            raise ValueError("trainer.backend=megatron: Llama with attention_bias or mlp_bias is not converted")
        heads = config.num_attention_heads
        return cls(layers=config.num_hidden_layers, heads=heads, groups=config.num_key_value_heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   qk_norm=kind == "qwen3", qkv_bias=kind == "qwen2", tied=bool(config.tie_word_embeddings))

    @property
    def q_per_group(self) -> int:
        return self.heads // self.groups


def _fuse_qkv(q, k, v, lay: Layout) -> torch.Tensor:
    """[heads*d, ...], [groups*d, ...] x 2 -> [groups*(q_per_group+2)*d, ...], grouped."""
    rest = q.shape[1:]
    q = q.reshape(lay.groups, lay.q_per_group * lay.head_dim, *rest)
    k = k.reshape(lay.groups, lay.head_dim, *rest)
    v = v.reshape(lay.groups, lay.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv, lay: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rest = qkv.shape[1:]
    g = qkv.reshape(lay.groups, (lay.q_per_group + 2) * lay.head_dim, *rest)
    q, k, v = g.split([lay.q_per_group * lay.head_dim, lay.head_dim, lay.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# per layer: megatron name <- HF name, for the tensors that map one to one
_SAME = {"self_attention.linear_proj.weight": "self_attn.o_proj.weight",
         "input_layernorm.weight": "input_layernorm.weight",
         "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
         "mlp.linear_fc2.weight": "mlp.down_proj.weight"}
_QK_NORM = {"self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "self_attention.k_layernorm.weight": "self_attn.k_norm.weight"}


def to_megatron(hf: dict[str, torch.Tensor], lay: Layout) -> dict[str, torch.Tensor]:
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not lay.tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(lay.layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        same = _SAME | (_QK_NORM if lay.qk_norm else {})
        out.update({m + mk: hf[h + hk] for mk, hk in same.items()})
        kinds = ("weight", "bias") if lay.qkv_bias else ("weight",)
        for kind in kinds:
            out[m + f"self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                *(hf[h + f"self_attn.{p}_proj.{kind}"] for p in "qkv"), lay)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
    return out


def to_hf(meg: dict[str, torch.Tensor], lay: Layout) -> dict[str, torch.Tensor]:
    """The HF tensors of what `meg` holds: the whole model, or a pipeline stage's part (its layers
    under their global numbers, tidal/modeling/megatron/stages.py)."""
    out = {}
    for hk, mk in (("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
                   ("model.norm.weight", "decoder.final_layernorm.weight"),
                   ("lm_head.weight", "embedding.word_embeddings.weight" if lay.tied else "output_layer.weight")):
        if mk in meg:
            out[hk] = meg[mk]
    for i in range(lay.layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        if m + "mlp.linear_fc1.weight" not in meg:  # another stage's layer
            continue
        same = _SAME | (_QK_NORM if lay.qk_norm else {})
        out.update({h + hk: meg[m + mk] for mk, hk in same.items()})
        for kind in ("weight", "bias") if lay.qkv_bias else ("weight",):
            q, k, v = _split_qkv(meg[m + f"self_attention.linear_qkv.{kind}"], lay)
            out.update({h + f"self_attn.q_proj.{kind}": q, h + f"self_attn.k_proj.{kind}": k,
                        h + f"self_attn.v_proj.{kind}": v})
        gate, up = meg[m + "mlp.linear_fc1.weight"].chunk(2)
        out.update({h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up})
    return out


def shard(meg: dict[str, torch.Tensor], lay: Layout, *, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of a full megatron state dict at tensor-parallel size tp: column-parallel
    layers (qkv, fc1, the vocabulary) cut along their outputs, row-parallel ones (proj, fc2) along
    their inputs, norms whole. fc1's rank part is [its gate rows; its up rows]."""
    if lay.groups % tp or lay.heads % tp:
        raise ValueError(f"trainer.tp={tp} must divide the model's {lay.heads} heads and {lay.groups} key/value heads")
    out = {}
    for name, t in meg.items():
        if name.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2)
            out[name] = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        elif name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
            out[name] = t.chunk(tp)[rank]  # qkv: whole query groups per rank
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            out[name] = t.chunk(tp, dim=1)[rank]
        else:
            out[name] = t
    return {k: v.contiguous() for k, v in out.items()}


# replicated over tp but applied to each rank's own heads only: their gradients are partial sums
# (megatron's finalize_model_grads all-reduces them over tp when qk_layernorm is on)
TP_PARTIAL_GRADS = ("q_layernorm.weight", "k_layernorm.weight")


def unshard(parts: list[dict[str, torch.Tensor]], lay: Layout, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The full megatron state dict from every tensor-parallel rank's part, in rank order (the
    inverse of `shard`); grads: the parts are gradients, and TP_PARTIAL_GRADS are summed."""
    out = {}
    for name in parts[0]:
        ts = [p[name] for p in parts]
        if len(ts) == 1:
            out[name] = ts[0]
        elif grads and name.endswith(TP_PARTIAL_GRADS):
            out[name] = torch.stack(ts).sum(dim=0)
        elif name.endswith("linear_fc1.weight"):
            halves = [t.chunk(2) for t in ts]
            out[name] = torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])])
        elif name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
            out[name] = torch.cat(ts)
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            out[name] = torch.cat(ts, dim=1)
        else:
            out[name] = ts[0]
    return out
