"""The presets in configs/ resolve, place and fit, on the published configs of their models
(in .venv-vllm: the presets generate with vLLM, and the recipe checks that it is installed).

What `--dry-run` prints, checked without the multi-GB weights: the model directory holds the model's
real config.json only (the values Qwen published), so the parameter count, the tp divisibility
checks and the memory estimate are the ones a user with the weights sees.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidal.controller.world import placement, world_size_of
from tidal.launch.cli import parser, resolve
from tidal.launch.dryrun import describe
from tidal.launch.memory import Shape, describe_memory, generator_parts, trainer_parts
from tidal.recipes.registry import recipe_for
from tests.e2e import ROOT

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000,
            "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
             "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# preset: (the model's config, world size, executor ranks, its device's memory in GB, published parameters)
PRESETS = {
    "qwen3-8b-16npu.yaml": (QWEN3_8B, 16, {"generator": 6, "reward": 2, "trainer": 8}, 64, 8.19e9),
    "qwen2.5-7b-8xh100.yaml": (QWEN25_7B, 8, {"generator": 3, "reward": 1, "trainer": 4}, 80, 7.62e9),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_places_and_fits(name, tmp_path):
    config, world, ranks, device_gb, params = PRESETS[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = parser().parse_args(["--algo", "grpo", "--config", str(ROOT / "configs" / name), "--dry-run",
                                "--set", f"model.path={tmp_path}"])
    cfg = resolve(args)
    recipe = recipe_for(cfg.algo)
    graph = recipe.build(cfg)  # the tp checks against the model's heads, MLP width and vocabulary
    assert world_size_of(graph) == world
    assert {ex: sum(len(u) for u in units) for ex, units in placement(graph).items()} == ranks
    shape = Shape.of(str(tmp_path))
    assert abs(shape.params - params) / params < 0.01  # the meta-device count is the published size
    trainer, generator = trainer_parts(cfg, shape), generator_parts(cfg, shape)
    assert sum(trainer.values()) < 0.8 * device_gb * 1e9, trainer  # room for the allocator and the rest
    # vLLM takes its share of the device (weights + KV cache); the push buffer lands beside it
    vllm_share = cfg.generator.vllm.gpu_memory_utilization * device_gb * 1e9
    assert generator["weights"] < vllm_share / 2 and vllm_share + generator["push buffer"] < 0.95 * device_gb * 1e9
    table = describe(graph, cfg, recipe, memory=describe_memory(cfg, shape))
    assert f"world size {world}" in table and "memory per rank" in table and f"{shape.params / 1e9:.2f}B" in table
