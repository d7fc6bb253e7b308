"""Memory per rank, estimated from the model's config and the run's layout (printed by --dry-run).

Exact for what is allocated per parameter: weights, their copies (fp32 master / bf16 compute,
reference, old policy), AdamW's two moments, the gradient accumulators. Rough for activations, which
depend on the responses: a full `token_budget` row of a Llama-style layer keeps about (8 h + 5 i)
values per token (h hidden, i MLP width), all of its layers without activation checkpointing, or
each layer's input plus one layer's working set with it; plus the LM head's chunk (logits,
log-probs and their gradient in fp32). The generator's KV cache is vLLM's share of the device
(`gpu_memory_utilization`) or, for the native engine, one inference chunk at full length.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from algorithms.kl import kl_in_loss
from algorithms.registry import get_algorithm
from executors.embedded import MODEL_SIZES
from executors.training.config import LearnerConfig
from recipes.config import RunConfig



def _size(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.0f} MB"
_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Shape:
    params: int
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    kv_width: int  # kv heads x head dim

    @classmethod
    def of(cls, path: str | None) -> "Shape | None":
        """From config.json alone (or the embedded model's sizes): --dry-run loads no model code. None:
        not a Llama-style decoder (GPT-2 names its sizes n_embd, n_layer, ...), so no estimate."""
        c = json.loads((Path(path) / "config.json").read_text()) if path else MODEL_SIZES
        if any(k not in c for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
                                    "num_attention_heads")):
            return None
        return cls.from_fields(c)

    @classmethod
    def from_fields(cls, c: dict) -> "Shape":
        """The parameter count of a Llama / Qwen2 / Qwen3 decoder (tests/test_memory.py checks it
        against the HF classes): embeddings, per layer q/k/v/o (+ Qwen2's q/k/v biases, Qwen3's q/k
        norms), the gated MLP and two norms, the final norm, and an untied LM head."""
        h, i, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
        heads, kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
        d = c.get("head_dim") or h // heads
        model_type = c.get("model_type", "qwen3")
        bias = model_type == "qwen2" or c.get("attention_bias", False)
        attention = h * heads * d + 2 * h * kv * d + heads * d * h + (heads * d + 2 * kv * d if bias else 0)
        attention += 2 * d if model_type == "qwen3" else 0
        mlp = 3 * h * i + (2 * i + h if c.get("mlp_bias", False) else 0)
        per_layer = attention + mlp + 2 * h
        params = vocab * h * (1 if c.get("tie_word_embeddings", False) else 2) + layers * per_layer + h
        return cls(params, h, i, layers, vocab, kv * d)


def learner_parts(t: LearnerConfig, m: Shape, *, stored: int, copies: int, passes: int, head: bool) -> dict[str, float]:
    """Bytes per rank of a model trained on groups (the trainer's policy, the critic's value model), by
    part. copies: forward-only copies (reference, old policy); passes: gradient accumulators; head:
    LM-head logits in chunks (the policy's log-probs, or a reference's)."""
    shard = t.tp * (t.dp if t.fsdp else 1)
    compute_copy = t.precision == "bf16" and not t.fsdp  # a bf16 copy beside the fp32 master
    copy_bytes = 2 if compute_copy else stored  # reference / old policy: copies of the compute weights
    act_bytes = 2 if t.precision == "bf16" or stored == 2 else 4
    per_token_layer = (8 * m.hidden + 5 * m.intermediate) * act_bytes / t.tp
    tokens = t.token_budget
    if t.activation_checkpointing:
        activations = tokens * (m.layers * m.hidden * act_bytes + per_token_layer)
    else:
        activations = tokens * m.layers * per_token_layer
    if head:
        head_rows = min(t.logprob_chunk or tokens, tokens)
        activations += 3 * head_rows * m.vocab * 4  # logits, log-probs, their gradient: fp32
    return {
        "weights": m.params * (stored + (2 if compute_copy else 0)) / shard,
        "ref/old copies": copies * m.params * copy_bytes / shard,
        "AdamW state": 2 * m.params * stored / shard,
        "grad accumulators": passes * m.params * (8 if t.fp64_grad_accumulation else 4) / shard,
        "activations (rough)": activations,
    }


def trainer_parts(cfg: RunConfig, m: Shape) -> dict[str, float]:
    t, algo = cfg.trainer, cfg.algo_config
    # a batch-scope algorithm's first pass keeps 2 gradients (3 with a KL in the loss): trainer/executor.py
    passes = 1 if get_algorithm(cfg.algo).advantage_scope != "batch" else 2 + int(kl_in_loss(algo))
    return learner_parts(t, m, stored=_BYTES[cfg.model.dtype], passes=passes, head=True,
                         copies=int(algo.needs_reference) + int(t.epochs * t.mini_batches > 1))


def critic_parts(cfg: RunConfig, m: Shape) -> dict[str, float]:
    """The value model (its head is one number per token: no logits) and, for a KL in the reward, the
    reference. The decoder's count stands for the value model's (its head is smaller than an LM head)."""
    reference = cfg.algo_config.critic_reference  # a critic runs with PPOConfig
    return learner_parts(cfg.critic, m, stored=_BYTES[cfg.model.dtype], copies=int(reference), passes=1, head=reference)


def generator_parts(cfg: RunConfig, m: Shape) -> dict[str, float]:
    g = cfg.generator
    dtype = 2 if cfg.trainer.precision == "bf16" or cfg.model.dtype == "bfloat16" else 4
    weights = m.params * dtype / g.tp
    parts = {"weights": weights, "push buffer": (weights if g.engine == "vllm" else 0)}
    if g.engine == "native":
        rows = g.max_batch_prompts * g.samples_per_prompt
        length = cfg.data.max_prompt_tokens + g.max_new_tokens
        parts["KV cache"] = rows * length * m.layers * 2 * m.kv_width * dtype / g.tp
    return parts


PARTS = {"generator": generator_parts, "critic": critic_parts, "trainer": trainer_parts}  # executors that hold a model


def describe_memory(cfg: RunConfig, m: Shape | None, *, executors: tuple[str, ...] = ("generator", "trainer")) -> str:
    """The table of --dry-run for the graph's `executors` (those of them that hold a model)."""
    if m is None:
        return ("memory per rank: no estimate for this model (the estimate counts Llama-style decoders: "
                "Llama, Qwen2, Qwen3, Mistral; its config.json lacks their sizes)")
    rows = []
    for name in (e for e in executors if e in PARTS):
        parts = PARTS[name](cfg, m)
        shown = ", ".join(f"{k} {_size(v)}" for k, v in parts.items() if v)
        total = _size(sum(parts.values()))
        if name == "generator" and cfg.generator.engine == "vllm":
            total += " + KV cache (vLLM: generator.vllm.gpu_memory_utilization or kv_cache_gb)"
        rows.append([name, shown, total])
    count = f"{m.params / 1e9:.2f}B" if m.params >= 1e9 else f"{m.params / 1e6:.1f}M"
    head = (f"memory per rank (estimate; {count} parameters, trainer precision "
            f"{cfg.trainer.precision}, activation checkpointing {'on' if cfg.trainer.activation_checkpointing else 'off'}):")
    return head + "\n" + tabulate(rows, headers=["executor", "parts", "total per rank"], disable_numparse=True)
