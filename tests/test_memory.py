"""tidal/launch/memory.py: the memory estimate --dry-run prints (the presets: tests_vllm/test_presets.py)."""
from __future__ import annotations

import pytest

from tidal.launch.memory import Shape, trainer_parts
from tests.fixtures import small_config


def test_memory_estimate_counts_each_copy():
    """The per-parameter parts against hand arithmetic: 1B parameters, no sharding."""
    shape = Shape(params=10**9, hidden=2048, intermediate=8192, layers=16, vocab=32000, kv_width=512)
    fp32 = trainer_parts(small_config(algorithm={"beta": 0.04}), shape)
    assert fp32["weights"] == 4e9 and fp32["ref/old copies"] == 4e9 and fp32["AdamW state"] == 8e9
    # float32: one pass sums in the parameters' own .grad; grad_spares=1 group of one micro-batch held
    assert fp32["grad accumulators"] == 0 and fp32["held gradients (grad_spares)"] == 4e9
    passes = trainer_parts(small_config(algo="reinforce_pp"), shape)  # batch scope: 2 passes, 2 accumulators
    assert passes["grad accumulators"] == 8e9
    fp64 = trainer_parts(small_config(trainer={"fp64_grad_accumulation": True}), shape)
    assert fp64["grad accumulators"] == 8e9 and fp64["held gradients (grad_spares)"] == 0
    bf16 = trainer_parts(small_config(algorithm={"beta": 0.04}, trainer={"precision": "bf16"}), shape)
    assert bf16["weights"] == 6e9 and bf16["ref/old copies"] == 2e9 and bf16["grad accumulators"] == 4e9
    assert bf16["held gradients (grad_spares)"] == 2e9  # bf16 gradients
    tp = trainer_parts(small_config(trainer={"tp": 2}), shape)
    assert tp["held gradients (grad_spares)"] == 0  # tp ranks take groups in index order: none held
    fsdp = trainer_parts(small_config(algorithm={"beta": 0.04}, trainer={"precision": "bf16", "fsdp": True, "dp": 4},
                                      data={"prompts_per_step": 4}), shape)
    assert fsdp["weights"] == 1e9 and fsdp["ref/old copies"] == 1e9 and fsdp["AdamW state"] == 2e9
    ac = trainer_parts(small_config(trainer={"activation_checkpointing": True}), shape)
    assert ac["activations (rough)"] < trainer_parts(small_config(), shape)["activations (rough)"] / 4


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_from_config_json_matches_the_model(family, tie):
    """--dry-run counts parameters from config.json alone; the HF class on the meta device agrees."""
    import torch
    import transformers

    sizes = dict(vocab_size=1000, hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
                 num_key_value_heads=2, tie_word_embeddings=tie)
    config = {"qwen3": lambda: transformers.Qwen3Config(head_dim=24, **sizes),
              "qwen2": lambda: transformers.Qwen2Config(**sizes), "llama": lambda: transformers.LlamaConfig(**sizes)}[family]()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert Shape.from_fields(config.to_dict()).params == sum(p.numel() for p in model.parameters())
    from tidal.modeling.hf import load_model

    assert Shape.of(None).params == sum(p.numel() for p in load_model(None).parameters())


def test_a_model_that_is_not_llama_style_gets_no_estimate_not_a_crash(tmp_path):
    """GPT-2 names its sizes n_embd, n_layer, ...: --dry-run says there is no estimate (it used to raise KeyError)."""
    import transformers

    from tidal.launch.memory import describe_memory

    transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=512).save_pretrained(tmp_path)
    assert Shape.of(str(tmp_path)) is None
    assert describe_memory(small_config(), None).startswith("memory per rank: no estimate for this model")


@pytest.mark.parametrize("mode", ["on", "off", "auto", "padded"])
def test_longest_micro_batch_is_the_one_the_trainer_packs(mode):
    """micro_batch_tokens against tidal/modeling/packing.py's own rows, prompt lengths 1..P: the
    activations are counted on the row the trainer really builds, not on a whole token_budget."""
    import torch

    from tidal.executors.learner.config import LearnerConfig
    from tidal.modeling.packing import make_micro_batches
    from tidal.launch.memory import micro_batch_tokens

    for P, R, G, budget in [(40, 8, 4, 4096), (3, 64, 4, 4096), (40, 8, 8, 100), (300, 50, 4, 256), (2, 9, 5, 30)]:
        t = LearnerConfig(shared_prompt=mode, token_budget=budget, micro_batch_size=3)
        longest = 0
        for p in range(1, P + 1):
            batches = make_micro_batches(torch.ones(p, dtype=torch.long), [torch.ones(R, dtype=torch.long)] * G,
                                         mode=mode, token_budget=budget, micro_batch_size=3, pad_id=0,
                                         device=torch.device("cpu"))
            # padded: the forward runs on the padding too
            longest = max(longest, max(mb.input_ids_NL.numel() if mode == "padded" else mb.input_ids_1L.numel()
                                       for mb in batches))
        assert micro_batch_tokens(t, prompt=P, response=R, samples=G)[0] == longest, (mode, P, R, G, budget)


# SmolLM2-135M-Instruct (a Llama), as its config.json gives it
SMOLLM2 = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)


@pytest.mark.parametrize("B, new_tokens, slots, measured", [
    # peak RSS (VmHWM) of each rank, python launch.py on the real model and HumanEval prompts, 2 steps, fp32,
    # G=4, generator.max_batch_prompts=slots (docs/big-models.md, Memory): (generator, trainer) bytes. The generator's
    # peak at slots=2 is its load, which the estimate's steady total leaves out (loading_peak: 1.43 GB)
    (4, 64, 16, (1.43e9, 4.28e9)),
    (8, 128, 16, (1.89e9, 4.90e9)),
    (4, 64, 2, (1.43e9, 4.37e9)),
])
def test_estimate_is_within_30_percent_of_measured_peaks(B, new_tokens, slots, measured):
    from tidal.launch.memory import PROCESS_BYTES, generator_parts

    shape = Shape.from_fields(SMOLLM2)
    assert round(shape.params / 1e6, 1) == 134.5
    cfg = small_config(data={"prompts_per_step": B, "max_prompt_tokens": 512},
                       generator={"samples_per_prompt": 4, "max_new_tokens": new_tokens, "max_batch_prompts": slots})
    for parts, peak in zip((generator_parts(cfg, shape), trainer_parts(cfg, shape)), measured):
        estimate = sum(parts.values()) + PROCESS_BYTES
        assert abs(estimate / peak - 1) < 0.3, (parts, peak)


def test_cpu_totals_count_the_process_and_the_load(tmp_path):
    """On CPU a rank holds its interpreter too, and while a model loads, the weights file's pages beside
    their copy (the generator's measured peak); a GPU's memory holds neither."""
    from tidal.modeling.hf import load_model, load_tokenizer, save_hf
    from tidal.launch.memory import PROCESS_BYTES, describe_memory, generator_parts, loading_peak

    save_hf(load_model(None), load_tokenizer(None), tmp_path)
    cfg = small_config(model={"path": str(tmp_path)}, data={"max_prompt_tokens": 8})  # a KV cache below the file
    shape = Shape.of(str(tmp_path))
    parts = {**generator_parts(cfg, shape), "process": PROCESS_BYTES}
    file_bytes = (tmp_path / "model.safetensors").stat().st_size
    assert loading_peak(cfg, parts) == PROCESS_BYTES + parts["weights"] + file_bytes
    assert loading_peak(small_config(), parts) == 0.0  # the embedded model is built, not loaded
    cpu = describe_memory(cfg, shape, device="cpu")
    assert "process 350 MB" in cpu and "while loading" in cpu.splitlines()[3]  # the generator's row
    cuda = describe_memory(cfg, shape, device="cuda")
    assert "process" not in cuda.split("\n", 1)[1] and "while loading" not in cuda
    assert "cuda runtime context, not counted" in cuda


def test_reward_model_gets_a_row_of_its_own(tmp_path):
    """reward.model: its ranks hold a one-logit classifier (no LM head), at the dtype it loads in; the
    combiner holds no model and gets no row."""
    import torch
    import transformers

    from tidal.executors.reward.model import load_reward_model
    from tidal.launch.memory import describe_memory, reward_model_parts

    cfg = small_config(reward={"model": {"scale": 2}})
    embedded = sum(p.numel() for p in load_reward_model(None, seed=0).parameters())
    assert Shape.of(None, classifier=True).params == embedded
    assert reward_model_parts(cfg, Shape.of(None))["weights"] == 4 * embedded  # built in float32
    names = ("generator", "reward", "reward_model", "combine", "trainer")
    text = describe_memory(cfg, Shape.of(None), executors=names, device="cuda")
    rows = {line.split()[0]: line for line in text.splitlines()[3:]}
    assert list(rows) == ["generator", "reward_model", "trainer"]
    assert "weights 3 MB" in rows["reward_model"]
    # a model directory: its own sizes and config.json's dtype (from_pretrained's "auto"), a new score head
    config = transformers.Qwen3Config(vocab_size=1000, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                                      num_attention_heads=6, num_key_value_heads=2, head_dim=24,
                                      tie_word_embeddings=False, num_labels=1, dtype="bfloat16")
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForSequenceClassification.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    parts = reward_model_parts(small_config(reward={"model": {"path": str(tmp_path)}}), Shape.of(None))
    assert parts["weights"] == 2 * params


def test_a_colocated_rank_holds_every_executor_and_the_kv_and_adam_take_turns():
    """placement=colocated: one rank holds the generator's and the trainer's parts, the generator's
    weights once (the push hands it the trainer's: tidal/channels/push_plan.py) where both have one layout;
    on a device its peak leaves out the smaller of the KV cache and AdamW's state (they are never there
    together), on CPU everything is one process's memory."""
    from tidal.launch.memory import PROCESS_BYTES, PARTS, _size, describe_memory

    row = lambda text: next(line for line in text.splitlines() if line.startswith("co-located rank"))  # noqa: E731
    shape = Shape.of(None)
    # tp 2 on both sides: the native engine's DTensor shards take a copy
    for trainer, generator, handed in (({}, {}, True), ({"lora": {"rank": 4}}, {}, False), ({"tp": 2}, {}, False),
                                       ({"tp": 2}, {"tp": 2}, False)):
        cfg = small_config(placement="colocated", schedule="sync", trainer=trainer, generator=generator)
        gen, trn = PARTS["generator"](cfg, shape), PARTS["trainer"](cfg, shape)
        total = sum(gen.values()) + sum(trn.values()) - (gen["weights"] if handed else 0)
        assert gen["weights"] > 0
        assert row(describe_memory(cfg, shape, device="cpu")).endswith(_size(total + PROCESS_BYTES))
        assert row(describe_memory(cfg, shape, device="cuda")).endswith(
            _size(total - min(gen["KV cache"], trn["AdamW state"])))
        assert ("the generator's weights: the trainer's own" in describe_memory(cfg, shape, device="cpu")) == handed
    assert "co-located rank" not in describe_memory(small_config(), shape, device="cuda")


# ---- pipeline stages (trainer.pp) and the presets that need them ----------------------------------
PUBLISHED = {  # the fields of the published config.json files the checks and estimates read
    "qwen2.5-32b-16xh200": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 27648,
        "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"},  # Qwen/Qwen2.5-32B-Instruct
    "llama-3-70b-32xh200": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16"},  # meta-llama/Meta-Llama-3-70B-Instruct
}


@pytest.mark.parametrize("tie", [True, False])
def test_pipeline_stages_hold_the_model_between_them(tie):
    """The stages' parameters add up to the model's (a tied head: the last stage's own copy more)."""
    from tidal.launch.memory import stage_shape

    m = Shape.from_fields({**PUBLISHED["qwen2.5-32b-16xh200"], "num_hidden_layers": 4, "tie_word_embeddings": tie})
    parts = [stage_shape(m, pp=4, stage=s) for s in range(4)]
    assert sum(p.params for p in parts) == m.params + (m.vocab * m.hidden if tie else 0)
    assert all(p.layers == 1 for p in parts) and parts[0].params > parts[1].params == parts[2].params


@pytest.mark.parametrize("preset, size, world", [("qwen2.5-32b-16xh200", 32.8e9, 16), ("llama-3-70b-32xh200", 70.6e9, 32)])
def test_the_pipeline_presets_place_and_fit(preset, size, world, tmp_path, monkeypatch):
    """On the published configs' shapes: the named world size, every check passes (pp divides the
    layers, tp the heads), and each trainer stage and generator rank fits an H200's 141 GB (the
    generator's KV cache is vLLM's share, gpu_memory_utilization)."""
    import dataclasses
    import json

    from tidal.controller.world import placement, world_size_of
    from tidal.executors.generator.engines import ENGINES
    from tidal.launch.cli import parser, resolve
    from tidal.launch.memory import describe_memory
    from tidal.recipes.registry import recipe_for
    from tests.e2e import ROOT

    # vLLM is not installed here: its check is the machine's, not the preset's
    monkeypatch.setitem(ENGINES._entries, "vllm", dataclasses.replace(ENGINES.get("vllm"), check=lambda *a: None))
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED[preset]))
    cfg = resolve(parser().parse_args(["--algo", "grpo", "--config", str(ROOT / "configs" / f"{preset}.yaml"),
                                       "--set", f"model.path={tmp_path}"]))
    graph = recipe_for(cfg.algo).build(cfg)
    assert world_size_of(graph) == world and len(placement(graph)["trainer"][0]) == cfg.trainer.tp * cfg.trainer.pp >= 8
    shape = Shape.of(str(tmp_path))
    assert abs(shape.params - size) / size < 0.01
    table = describe_memory(cfg, shape, device="cuda")
    stages = [line for line in table.splitlines() if line.startswith("trainer stage")]
    assert len(stages) == cfg.trainer.pp
    for line in stages:
        assert float(line.split()[-2]) < 0.8 * 141, line  # GB
    generator = next(line for line in table.splitlines() if line.startswith("generator"))
    util = cfg.generator.vllm.gpu_memory_utilization
    push = float(generator.split("push buffer ")[1].split()[0])
    assert util * 141 + push < 141, generator


def test_a_kv_budget_bounds_the_estimated_kv_cache():
    """generator.kv_budget_tokens: the estimate's KV cache is the budget's positions, not the slots' (the engine
    holds fewer groups at once rather than exceed it); a budget above the slots' leaves it as it was."""
    from tidal.launch.memory import generator_parts

    shape = Shape.from_fields(SMOLLM2)
    base = dict(samples_per_prompt=4, max_new_tokens=64, max_batch_prompts=4)
    cfg = small_config(data={"prompts_per_step": 8, "max_prompt_tokens": 64}, generator=base)
    kv = generator_parts(cfg, shape)["KV cache"]
    assert kv == 16 * 128 * shape.layers * 2 * shape.kv_width * 4  # 16 slots x 128 positions, fp32
    for budget, want in ((512, kv / 4), (10 ** 6, kv)):
        cfg = small_config(data={"prompts_per_step": 8, "max_prompt_tokens": 64},
                           generator={**base, "kv_budget_tokens": budget})
        assert generator_parts(cfg, shape)["KV cache"] == want


def test_the_long_context_preset_splits_its_rows_and_fits(tmp_path, monkeypatch):
    """configs/qwen3-8b-long-16xh200.yaml on Qwen3-8B's published shape: 16 ranks, a trainer unit of 4 cp ranks,
    and a trainer rank within an H200's 141 GB without activation checkpointing because cp splits the 33k-token row
    (one rank holding it would not be)."""
    import dataclasses
    import json

    from tidal.controller.world import placement, world_size_of
    from tidal.executors.generator.engines import ENGINES
    from tidal.launch.cli import parser, resolve
    from tidal.launch.memory import describe_memory
    from tidal.recipes.registry import recipe_for
    from tests.e2e import ROOT

    monkeypatch.setitem(ENGINES._entries, "vllm", dataclasses.replace(ENGINES.get("vllm"), check=lambda *a: None))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False}))  # Qwen/Qwen3-8B

    def trainer_gb(*overrides):
        cfg = resolve(parser().parse_args(["--algo", "grpo", "--config", str(ROOT / "configs" / "qwen3-8b-long-16xh200.yaml"),
                                           "--set", f"model.path={tmp_path}", *overrides]))
        table = describe_memory(cfg, Shape.of(str(tmp_path)), device="cuda")
        return cfg, float(next(line for line in table.splitlines() if line.startswith("trainer")).split()[-2])

    cfg, gb = trainer_gb()
    graph = recipe_for(cfg.algo).build(cfg)
    assert world_size_of(graph) == 16 and len(placement(graph)["trainer"][0]) == cfg.trainer.cp == 4
    assert gb < 0.8 * 141
    _, whole = trainer_gb("--set", "trainer.cp=1", "--set", "trainer.dp=8")
    assert whole > 141 > gb
