"""Memory per rank, estimated from the model's config and the run's layout (printed by --dry-run).

Exact for what is allocated per parameter: weights, their copies (fp32 master / bf16 compute,
reference, old policy), AdamW's two moments, the gradient accumulators, and the backward's own
gradient (each micro-batch's .grad, before it is added to the accumulators). Rough for activations,
which depend on the responses: the longest micro-batch row one group can make (the prompt at
data.max_prompt_tokens, every response at generator.max_new_tokens, packed as trainer.shared_prompt
and trainer.token_budget pack it; the whole token_budget only when a group fills it) keeps about
(8 h + 5 i) values per token and layer (h hidden, i MLP width), all of its layers without activation
checkpointing, or each layer's input plus one layer's working set with it; plus the LM head's chunk
(logits, log-probs and their gradient in fp32) over the row's response tokens. The generator's KV
cache is vLLM's share of the device (`gpu_memory_utilization`) or, for the native engine, the rows
that decode together (one admission chunk of the step's prompts, G samples each) at full length.
A reward model (reward.model) counts its own weights (a one-logit classifier, from its own config.json)
and, rough, one layer's working set over a group's G sequences at full length.
On CPU a rank's total adds the process itself (python, torch, transformers: PROCESS_BYTES, measured)
and names the moment a model loads when that is the peak (loading_peak); on a GPU/NPU the runtime
context is not counted. docs/big-models.md "Memory" gives the estimates against measured peaks.
"""
from __future__ import annotations

import dataclasses
import math
import json
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from tidal.algorithms.kl import kl_in_loss
from tidal.algorithms.registry import get_algorithm
from tidal.modeling.pack_rule import auto_shared_prompt
from tidal.modeling.tiny import MODEL_SIZES
from tidal.executors.generator.engines import ENGINES
from tidal.executors.trainer.backends import BACKENDS
from tidal.modeling.lora import ALL_LINEAR
from tidal.executors.learner.config import LearnerConfig
from tidal.recipes.config import RunConfig



def _size(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.0f} MB"
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# peak RSS of a rank's process before it builds anything (python, torch, transformers imported),
# measured on CPU: 0.25 GB at start-up, 0.33 GB on a reward rank holding a tokenizer
PROCESS_BYTES = 0.35e9


@dataclass(frozen=True)
class Shape:
    params: int
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    kv_width: int  # kv heads x head dim
    expert_params: int = 0  # mixture of experts: every expert's weights (split over trainer.ep), of `params`
    head_params: int = 0  # an untied LM head's (0: tied to the embedding)
    active_params: int = 0  # mixture of experts: the parameters one token runs through; 0: all (dense)
    # the decoder's Linear modules by name: (in, out, how many layers have it), for LoRA's adapters
    linears: tuple[tuple[str, int, int, int], ...] = ()

    def lora_params(self, *, rank: int, targets: list[str]) -> int:
        """The parameters of rank-`rank` adapters on the `targets` Linear modules: r x (in + out) each."""
        return sum(rank * (n_in + n_out) * count for name, n_in, n_out, count in self.linears if name in targets)

    @classmethod
    def of(cls, path: str | None, *, classifier: bool = False) -> "Shape | None":
        """From config.json alone (or the embedded model's sizes): --dry-run loads no model code. None:
        not a Llama-style decoder (GPT-2 names its sizes n_embd, n_layer, ...), so no estimate.
        classifier: as AutoModelForSequenceClassification builds it with one label (a reward model): the
        decoder and a score head of hidden x 1 instead of the LM head."""
        c = _config_json(path)
        if any(k not in c for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
                                    "num_attention_heads")):
            return None
        if classifier:
            shape = cls.from_fields({**c, "tie_word_embeddings": True})  # the embeddings only, once
            return dataclasses.replace(shape, params=shape.params + shape.hidden)
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
        attention += 2 * d if model_type in ("qwen3", "qwen3_moe") else 0
        mlp = 3 * h * i + (2 * i + h if c.get("mlp_bias", False) else 0)
        per_layer = attention + mlp + 2 * h
        params = vocab * h * (1 if c.get("tie_word_embeddings", False) else 2) + layers * per_layer + h
        E = c.get("num_experts") or c.get("num_local_experts")  # the published name; transformers 5 writes the other
        step, dense_layers = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or ())
        routed = sum(1 for n in range(layers) if n not in dense_layers and (n + 1) % step == 0) if E else 0
        linears = (("q_proj", h, heads * d, layers), ("k_proj", h, kv * d, layers), ("v_proj", h, kv * d, layers),
                   ("o_proj", heads * d, h, layers), ("gate_proj", h, i, layers - routed), ("up_proj", h, i, layers - routed),
                   ("down_proj", i, h, layers - routed))
        head = 0 if c.get("tie_word_embeddings", False) else vocab * h
        if not E:
            return cls(params, h, i, layers, vocab, kv * d, head_params=head, linears=linears)
        # Qwen3-MoE: a routed layer's MLP is E experts of 3 x h x moe_intermediate_size and a router h x E
        k, mi = c["num_experts_per_tok"], c["moe_intermediate_size"]
        experts = routed * E * 3 * h * mi
        params += routed * (experts // routed + h * E - mlp)
        active = params - experts + routed * k * 3 * h * mi
        # activations: a routed layer's MLP holds k expert rows per token
        return cls(params, h, k * mi if routed == layers else i, layers, vocab, kv * d, expert_params=experts,
                   active_params=active, head_params=head, linears=linears)


def stage_shape(m: Shape, *, pp: int, stage: int) -> Shape:
    """What pipeline stage `stage` of pp holds (tidal/modeling/megatron/stages.py): layers/pp decoder layers, the
    embedding on the first, the final norm and the LM head on the last (a tied head: its own copy)."""
    embed = m.vocab * m.hidden
    per_layer = (m.params - embed - m.head_params - m.hidden) / m.layers
    params = per_layer * m.layers / pp + (embed if stage == 0 else 0)
    params += (m.hidden + (m.head_params or embed)) if stage == pp - 1 else 0
    return dataclasses.replace(m, params=int(params), layers=m.layers // pp, expert_params=m.expert_params // pp)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _config_json(path: str | None) -> dict:
    return json.loads((Path(path) / "config.json").read_text()) if path else MODEL_SIZES


def _row(*, prompt: int, response: int, samples: int, budget: int, shared: bool) -> tuple[int, int]:
    """(tokens, response tokens) of the first row packing.py's greedy split makes of a group whose
    samples are all `response` long: the longest, as every later row holds at most as many samples."""
    if shared:  # [prompt, r_1, ..., r_n]: the prompt once
        n = max(1, min(samples, (budget - prompt) // response))
        return prompt + n * response, n * response
    n = max(1, min(samples, budget // (prompt + response)))  # n rows [prompt, r_i] back to back
    return n * (prompt + response), n * response


def _auto_shares(prompt: int, response: int, samples: int) -> bool:
    """shared_prompt=auto's choice for responses all `response` long: the trainer's rule itself."""
    return auto_shared_prompt(prompt, [response] * samples)


def micro_batch_tokens(t: LearnerConfig, *, prompt: int, response: int, samples: int) -> tuple[int, int]:
    """(tokens, response tokens) of the longest micro-batch the learner runs on a group of `samples`
    responses of at most `response` tokens to a prompt of at most `prompt` tokens. The whole
    token_budget (4096 by default) counts only when a group fills it: at B=4, G=4, 64 new tokens on
    SmolLM2-135M it made the estimate 2.2x the measured peak."""
    if t.shared_prompt == "padded":
        n = min(t.micro_batch_size, samples)
        return n * (prompt + response), n * response
    # every prompt length up to the cap: a shorter prompt can leave room for one more sample in a row,
    # and auto shares the prompt of long prompts only
    shared = {"on": lambda p: True, "off": lambda p: False}.get(
        t.shared_prompt, lambda p: _auto_shares(p, response, samples))
    return max(_row(prompt=p, response=response, samples=samples, budget=t.token_budget, shared=shared(p))
               for p in range(1, prompt + 1))


def micro_batches_per_group(t: LearnerConfig, *, prompt: int, response: int, samples: int) -> int:
    """At most how many micro-batches one group of `samples` responses becomes (packed: its tokens over
    token_budget, the prompt counted per sample unless shared_prompt=on)."""
    if t.shared_prompt == "padded":
        return math.ceil(samples / t.micro_batch_size)
    tokens = prompt + samples * response if t.shared_prompt == "on" else samples * (prompt + response)
    return max(1, math.ceil(tokens / t.token_budget))


def held_gradients(t: LearnerConfig, *, micro_batches: int) -> int:
    """Gradient-sized buffers that float32 accumulation may hold for groups trained ahead of their turn
    (tidal/executors/learner/order.py IndexOrderedSum): none where the layout takes groups in index order."""
    return 0 if t.fp64_grad_accumulation or t.index_ordered else t.grad_spares * micro_batches


def learner_parts(t: LearnerConfig, m: Shape, *, stored: int, copies: int, passes: int, head: bool,
                  tokens: tuple[int, int], adapters: int = 0, micro_batches: int = 1, in_flight: int = 1,
                  zero: bool = False) -> dict[str, float]:
    """Bytes per rank of a model trained on groups (the trainer's policy, the critic's value model), by
    part. copies: forward-only copies (reference, old policy); passes: gradient accumulators; head:
    LM-head logits in chunks (the policy's log-probs, or a reference's); tokens: the longest
    micro-batch's (tokens, response tokens), micro_batch_tokens; adapters: LoRA's parameters, the only
    ones trained (the base frozen: no optimizer state, accumulators or gradient of its own);
    micro_batches: per group, micro_batches_per_group. in_flight: micro-batches whose activations a pipeline
    stage holds at once (1F1B: pp - stage); zero: AdamW's state sharded over dp (the megatron backend's ZeRO-1)."""
    shard = t.tp * (t.dp * t.cp if t.fsdp else 1)  # FSDP shards over dp x cp (tidal/modeling/parallel/cp.py)
    # with expert parallel a rank holds 1/ep of the experts: as if the model had this many parameters
    params = m.params - m.expert_params + m.expert_params / t.ep
    m = dataclasses.replace(m, params=params)
    trained = adapters or m.params
    half = t.precision in ("bf16", "fp16")  # a 2-byte compute dtype
    compute_copy = half and not t.fsdp  # a bf16/fp16 copy beside the fp32 master
    in_place = (passes == 1 and not t.fp64_grad_accumulation and t.precision == "fp32" and stored == 4
                and t.tp == 1 and not t.fsdp and t.ep == 1)
    copy_bytes = 2 if compute_copy else stored  # reference / old policy: copies of the compute weights
    act_bytes = 2 if half or stored == 2 else 4
    per_token_layer = (8 * m.hidden + 5 * m.intermediate) * act_bytes / t.tp
    row, responses = tokens
    gathered = 0  # context parallel: a layer keeps the whole row's keys and values, gathered from the cp ranks
    if t.cp > 1:
        gathered = 2 * row * m.kv_width * act_bytes
        row, responses = -(-row // t.cp), -(-responses // t.cp)
    if t.activation_checkpointing:
        activations = row * (in_flight * m.layers * m.hidden * act_bytes + per_token_layer) + gathered
    else:
        activations = in_flight * (row * m.layers * per_token_layer + m.layers * gathered)
    if head:
        head_rows = min(t.logprob_chunk or responses, responses)
        activations += 3 * head_rows * m.vocab * 4  # logits, log-probs, their gradient: fp32
    return {
        "weights": (m.params + adapters) * (stored + (2 if compute_copy else 0)) / shard,
        "ref/old copies": copies * m.params * copy_bytes / shard,
        "AdamW state": 2 * trained * stored / shard / (t.dp if zero else 1),
        # one float32 pass over plain float32 parameters sums in their own .grad (tidal/modeling/optim.py InPlaceGradients)
        "grad accumulators": 0 if in_place else passes * trained * (8 if t.fp64_grad_accumulation else 4) / shard,
        # the backward writes each micro-batch's gradient in the compute dtype before it is accumulated
        "gradient": trained * (2 if half else stored) / shard,
        "held gradients (grad_spares)": held_gradients(t, micro_batches=micro_batches) * passes * trained
        * (2 if half else stored) / shard,
        "activations (rough)": activations,
    }


def _adapters(cfg: RunConfig, m: Shape) -> int:
    """trainer.lora's parameters (0 without LoRA)."""
    lora = cfg.trainer.lora
    return m.lora_params(rank=lora.rank, targets=lora.target_modules or ALL_LINEAR) if lora.on else 0


def _group_micro_batches(cfg: RunConfig, t: LearnerConfig) -> int:
    return micro_batches_per_group(t, prompt=cfg.data.max_prompt_tokens, response=cfg.response_tokens,
                                   samples=cfg.generator.samples_per_prompt)


def _group_tokens(cfg: RunConfig, t: LearnerConfig) -> tuple[int, int]:
    return micro_batch_tokens(t, prompt=cfg.data.max_prompt_tokens, response=cfg.response_tokens,
                              samples=cfg.generator.samples_per_prompt)


def trainer_parts(cfg: RunConfig, m: Shape, *, stage: int = 0) -> dict[str, float]:
    """The trainer's ranks (with trainer.pp > 1: those of pipeline stage `stage`)."""
    t, algo = cfg.trainer, cfg.algo_config
    # a batch-scope algorithm's first pass keeps 2 gradients (3 with a KL in the loss): trainer/executor.py
    passes = 1 if get_algorithm(cfg.algo).advantage_scope != "batch" else 2 + int(kl_in_loss(algo))
    if t.pp > 1:
        m = stage_shape(m, pp=t.pp, stage=stage)
    return learner_parts(t, m, stored=_BYTES[cfg.model.dtype], passes=passes, head=stage == t.pp - 1,
                         in_flight=t.pp - stage, zero=BACKENDS.get(t.backend).per_rank_optimizer,
                         # with LoRA the reference is the base itself (adapters off): no copy
                         copies=int(algo.needs_reference and not t.lora.on) + int(t.epochs * t.mini_batches > 1),
                         tokens=_group_tokens(cfg, t), micro_batches=_group_micro_batches(cfg, t),
                         adapters=_adapters(cfg, m))


def critic_parts(cfg: RunConfig, m: Shape) -> dict[str, float]:
    """The value model (its head is one number per token: no logits) and, for a KL in the reward, the
    reference. The decoder's count stands for the value model's (its head is smaller than an LM head)."""
    reference = cfg.algo_config.critic_reference  # a critic runs with PPOConfig
    return learner_parts(cfg.critic, m, stored=_BYTES[cfg.model.dtype], copies=int(reference), passes=1, head=reference,
                         tokens=_group_tokens(cfg, cfg.critic), micro_batches=_group_micro_batches(cfg, cfg.critic))


def generator_parts(cfg: RunConfig, m: Shape) -> dict[str, float]:
    g = cfg.generator
    dtype = 2 if cfg.trainer.precision in ("bf16", "fp16") or cfg.model.dtype == "bfloat16" else 4
    weights = m.params * dtype / g.tp
    engine = ENGINES.get(g.engine)
    adapters = _adapters(cfg, m) * dtype  # with LoRA the pushes, and the engine's copy of them, are the adapters
    parts = {"weights": weights + adapters, "push buffer": (adapters or weights) if engine.push_buffer else 0}
    if not engine.kv_note:  # the memory estimate sizes its KV cache
        # the rows that decode together: a replica's share of the step's prompts (or of the evaluation's),
        # at most max_batch_prompts of them; max_batch_prompts alone counted 4x the rows at B=4, G=4
        # (multi-turn: twice the groups, as samples that wait for their environment keep their slots)
        def rows(prompts: int, samples: int) -> int:
            groups = g.max_batch_prompts * (2 if cfg.rollout == "multi_turn" else 1)
            return min(groups, -(-prompts // g.replicas)) * samples

        shapes = [(rows(cfg.data.prompts_per_step, g.samples_per_prompt), cfg.response_tokens)]
        if cfg.eval.every:
            shapes.append((rows(cfg.eval.prompts, cfg.eval.samples), cfg.eval.max_new_tokens or g.max_new_tokens))
        row_tokens = max(n * (cfg.data.max_prompt_tokens + new) for n, new in shapes)
        if g.kv_budget_tokens is not None:  # the engine holds fewer groups at once rather than exceed it
            row_tokens = min(row_tokens, g.kv_budget_tokens)
        parts["KV cache"] = row_tokens * m.layers * 2 * m.kv_width * dtype / g.tp
    return parts


def reward_model_parts(cfg: RunConfig, m: Shape) -> dict[str, float] | None:
    """reward.model's ranks (not the policy's shape `m`: its own, a one-logit classifier): its weights
    at the dtype it loads in (from_pretrained's "auto": config.json's; the embedded random one float32)
    and, rough, one layer's working set over a group's sequences (inference: no layer keeps its
    activations). None: its config.json is not a Llama-style decoder's, no estimate."""
    rm = cfg.reward.model
    shape = Shape.of(rm.path, classifier=True)
    if shape is None:
        return None
    c = _config_json(rm.path)
    dtype = _BYTES.get(str(c.get("dtype") or c.get("torch_dtype") or "float32"), 4) if rm.path else 4
    tokens = cfg.generator.samples_per_prompt * (cfg.data.max_prompt_tokens + cfg.response_tokens)
    return {"weights": shape.params * dtype,
            "activations (rough)": tokens * (8 * shape.hidden + 5 * shape.intermediate) * dtype}


# executors that hold a model; a function of (cfg, the policy's shape) -> bytes by part (None: no estimate)
PARTS = {"generator": generator_parts, "reward_model": reward_model_parts, "critic": critic_parts,
         "trainer": trainer_parts}


def loading_peak(cfg: RunConfig, parts: dict[str, float], *, executor: str = "generator") -> float:
    """A CPU rank's memory while its model loads: from_pretrained maps the weights file, and the copy
    that gives the weights memory of their own (tidal/modeling/hf.py, in_own_memory) sits beside the file's
    pages until the load ends. Measured: the generator's peak on SmolLM2-135M (1.43 GB) is this moment.
    0 for the embedded model (built, not loaded). executor: whose model (the reward model has its own path)."""
    path = cfg.reward.model.path if executor == "reward_model" else cfg.model.path
    if not path:
        return 0.0
    from tidal.modeling.hf import WEIGHTS_FILES

    files = [f for f in Path(path).iterdir() if f.name in WEIGHTS_FILES or
             (f.name.startswith(("model-", "pytorch_model-")) and f.suffix in (".safetensors", ".bin"))]
    return parts.get("process", 0.0) + parts["weights"] + sum(f.stat().st_size for f in files)


def colocated_bytes(every: list[dict[str, float]], *, device: str) -> float:
    """placement=colocated: one rank holds every executor's parts. On a device the KV cache and
    AdamW's state take turns (the engine releases its cache to train; the state is in host memory
    while generating), so its peak holds the larger of the two; on CPU all of it is host memory."""
    total = sum(v for parts in every for v in parts.values())
    if device == "cpu":
        return total + PROCESS_BYTES
    kv = sum(parts.get("KV cache", 0) for parts in every)
    adam = sum(parts.get("AdamW state", 0) for parts in every)
    return total - min(kv, adam)


def handed_over(cfg: RunConfig) -> str | None:
    """placement=colocated: the generator's part that the push replaces by the trainer's own tensors
    (whole tensors a rank sends itself in one layout and dtype are handed over, not copied:
    tidal/channels/push_plan.py), so the rank holds it once, from the first push on: the native engine's
    weights, vLLM's push buffer. None where the layouts differ (tp, FSDP, EP), the native engine's
    weights are tp-sharded DTensors (it copies into their shards) or the push carries LoRA's
    adapters alone (the engine keeps its own base). The dtypes agree: the trainer pushes what the
    generator runs in."""
    t, g = cfg.trainer, cfg.generator
    if cfg.placement != "colocated" or g.tp != t.tp or t.fsdp or t.ep > 1 or t.lora.on:
        return None
    if ENGINES.get(g.engine).push_buffer:
        return "push buffer"
    return "weights" if g.tp == 1 else None


def _colocated_row(every: list[dict[str, float]], *, device: str, handed: str | None) -> list[str]:
    how = "every row above, one process" if device == "cpu" else "every row above; the KV cache and AdamW state take turns"
    if handed:
        how += f"; the generator's {handed}: the trainer's own weights, counted once (the push hands them over)"
    return ["co-located rank", how, _size(colocated_bytes(every, device=device))]


def _parts(cfg: RunConfig, m: Shape, name: str) -> list[tuple[str, dict[str, float] | None]]:
    """(row label, parts) of one executor: the trainer's pipeline stages each a row of their own."""
    if name == "trainer" and cfg.trainer.pp > 1:
        return [(f"trainer stage {s}", trainer_parts(cfg, m, stage=s)) for s in range(cfg.trainer.pp)]
    return [(name, PARTS[name](cfg, m))]


def describe_memory(cfg: RunConfig, m: Shape | None, *, executors: tuple[str, ...] = ("generator", "trainer"),
                    device: str | None = None) -> str:
    """The table of --dry-run for the graph's `executors` (those of them that hold a model). device:
    cpu, cuda or npu (default: this machine's); on CPU a rank's total includes the process itself."""
    if m is None:
        return ("memory per rank: no estimate for this model (the estimate counts Llama-style decoders: "
                "Llama, Qwen2, Qwen3, Mistral; its config.json lacks their sizes)")
    if device is None:
        from tidal.controller.devices import detect_device

        device = detect_device().type
    rows, every, staged = [], [], []
    stages = cfg.trainer.pp
    for name, parts in ((label, parts) for e in executors if e in PARTS for label, parts in _parts(cfg, m, e)):
        if parts is None:
            rows.append([name, "no estimate (its config.json lacks a Llama-style decoder's sizes)", "?"])
            continue
        handed = handed_over(cfg) if name == "generator" else None
        if name.startswith("trainer stage "):  # co-located, a rank holds one stage: the largest counts
            staged.append(dict(parts))
        else:
            every.append({**parts, **({handed: 0.0} if handed else {})})
        if device == "cpu":  # host memory is the rank's whole RSS; a device's holds no interpreter
            parts["process"] = PROCESS_BYTES
        shown = ", ".join(f"{k} {_size(v)}" for k, v in parts.items() if v)
        total = _size(sum(parts.values()))
        loading = loading_peak(cfg, parts, executor=name.split(" stage ")[0]) if device == "cpu" else 0.0
        if loading > sum(parts.values()):
            total += f" ({_size(loading)} while loading)"
        note = ENGINES.get(cfg.generator.engine).kv_note
        if name == "generator" and note:
            total += f" + {note}"
        elif name == "generator" and cfg.generator.kv_memory_fraction is not None:  # the engine's bound, read at its start
            total += f" (KV cache at most {cfg.generator.kv_memory_fraction:g} of the memory free at its start)"
        rows.append([name, shown, total])
    if staged:
        every.append(max(staged, key=lambda parts: sum(parts.values())))
    if cfg.placement == "colocated" and every:
        rows.append(_colocated_row(every, device=device, handed=handed_over(cfg)))
    count = _count(m.params) + (f" ({_count(m.active_params)} active per token)" if m.active_params else "")
    where = ("process: python with torch and transformers, as measured on CPU" if device == "cpu" else
             f"plus each rank's {device} runtime context, not counted")
    ac = "on" if cfg.trainer.activation_checkpointing else "off"
    pipeline = (f"; trainer.pp={stages}: a stage's layers, {stages} - stage micro-batches' activations in flight"
                if stages > 1 else "")
    head = (f"memory per rank (estimate; {count} parameters, trainer precision {cfg.trainer.precision}, "
            f"activation checkpointing {ac}{pipeline}; prompts at data.max_prompt_tokens; {where}):")
    return head + "\n" + tabulate(rows, headers=["executor", "parts", "total per rank"], disable_numparse=True)
