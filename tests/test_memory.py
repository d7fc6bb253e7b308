"""launch/memory.py: the memory estimate --dry-run prints (the presets: tests_vllm/test_presets.py)."""
from __future__ import annotations

import pytest

from launch.memory import Shape, trainer_parts
from tests.fixtures import small_config


def test_memory_estimate_counts_each_copy():
    """The per-parameter parts against hand arithmetic: 1B parameters, no sharding."""
    shape = Shape(params=10**9, hidden=2048, intermediate=8192, layers=16, vocab=32000, kv_width=512)
    fp32 = trainer_parts(small_config(algorithm={"beta": 0.04}), shape)
    assert fp32["weights"] == 4e9 and fp32["ref/old copies"] == 4e9 and fp32["AdamW state"] == 8e9
    assert fp32["grad accumulators"] == 8e9
    bf16 = trainer_parts(small_config(algorithm={"beta": 0.04}, trainer={"precision": "bf16",
                                                                         "fp64_grad_accumulation": False}), shape)
    assert bf16["weights"] == 6e9 and bf16["ref/old copies"] == 2e9 and bf16["grad accumulators"] == 4e9
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
    from executors.hf import load_model

    assert Shape.of(None).params == sum(p.numel() for p in load_model(None).parameters())


def test_a_model_that_is_not_llama_style_gets_no_estimate_not_a_crash(tmp_path):
    """GPT-2 names its sizes n_embd, n_layer, ...: --dry-run says there is no estimate (it used to raise KeyError)."""
    import transformers

    from launch.memory import describe_memory

    transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=512).save_pretrained(tmp_path)
    assert Shape.of(str(tmp_path)) is None
    assert describe_memory(small_config(), None).startswith("memory per rank: no estimate for this model")
