"""docs/status.md's refusals are the config's: every refusal the page lists is raised, before any rank starts, by
the checks a launch runs (tidal/recipes/grpo.py's build), with a message naming the setting. A refusal lifted without
the page changing, or a claim removed from the page while the refusal stays, fails here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import transformers

from tidal.modeling import numerics
from tidal.modeling.tiny.moe import write_embedded_moe
from tidal.recipes.checks import check_numerics
from tidal.recipes.grpo import build
from tests.fixtures import small_config

STATUS = re.sub(r"\s+", " ", (Path(__file__).resolve().parents[1] / "docs" / "status.md").read_text())
EXACT = {"model": {"numerics": "exact"}}

# (words of the page, the config a launch checks: algorithm and sections, the error's words)
REFUSALS = {
    "exact numerics with vLLM": ("refused with vLLM, megatron, tp or ep > 1", "grpo",
                                 {**EXACT, "generator": {"engine": "vllm"}}, r"model.numerics=exact with generator.engine=vllm"),
    "exact numerics with megatron": ("refused with vLLM, megatron, tp or ep > 1", "grpo",
                                     {**EXACT, "trainer": {"backend": "megatron"}}, r"with trainer.backend=megatron"),
    "exact numerics with trainer tp": ("refused with vLLM, megatron, tp or ep > 1", "grpo",
                                       {**EXACT, "trainer": {"tp": 2}}, r"model.numerics=exact with trainer.tp=2"),
    "exact numerics with generator tp": ("refused with vLLM, megatron, tp or ep > 1", "grpo",
                                         {**EXACT, "generator": {"tp": 2}}, r"model.numerics=exact with generator.tp=2"),
    "pipeline with batch-scope advantages": ("batch-scope advantages, two loss passes per micro-batch, are refused",
                                             "reinforce_pp", {"trainer": {"backend": "megatron", "pp": 2}},
                                             r"trainer.pp=2 with algorithm 'reinforce_pp'"),
    "FSDP over dp with DAPO": ("FSDP with `trainer.dp` > 1 refuses DAPO's dynamic sampling", "dapo",
                               {"trainer": {"dp": 2, "fsdp": True}}, r"dynamic_sampling with trainer.fsdp"),
    "multi-turn partial rollouts": ("multi-turn with partial rollouts (refused", "grpo",
                                    {"rollout": "multi_turn", "generator": {"partial_rollout_tokens": 2}},
                                    r"partial_rollout_tokens=2 with rollout=multi_turn"),
    "co-located, periodic": ("`placement=colocated` runs the `sync` schedule only", "grpo",
                             {"placement": "colocated"}, r"placement=colocated with schedule periodic"),
    "co-located vLLM": ("with the native engine on CPU (vLLM's sleep mode is CUDA/Ascend's)", "grpo",
                        {"placement": "colocated", "schedule": {"kind": "sync"}, "generator": {"engine": "vllm"}},
                        r"placement=colocated with generator.engine=vllm"),
    "LoRA with tp": ("tp/FSDP/bf16 masters with LoRA", "grpo", {"trainer": {"lora": {"rank": 8}, "tp": 2}},
                     r"lora.rank=8 with trainer.tp=2"),
    "LoRA with FSDP": ("tp/FSDP/bf16 masters with LoRA", "grpo",
                       {"trainer": {"lora": {"rank": 8}, "fsdp": True, "dp": 2}}, r"trainer.fsdp=True"),
    "LoRA with bf16 masters": ("tp/FSDP/bf16 masters with LoRA", "grpo",
                               {"trainer": {"lora": {"rank": 8}, "precision": "bf16"}},
                               r"lora.rank=8 with trainer.precision=bf16"),
}
MOE_REFUSALS = {  # the tiny mixture-of-experts model's path filled in
    "vLLM with a mixture of experts": ("vLLM is refused for MoE models", {"generator": {"engine": "vllm"}},
                                       r"generator.engine=vllm with a mixture-of-experts model"),
    "tp with a mixture of experts": ("as are tp for an MoE model", {"trainer": {"tp": 2}},
                                     r"trainer.tp=2 does not fit the model.*qwen3_moe"),
}
MODEL_REFUSALS = {  # exact numerics on a model's architecture, checked from its config.json
    "exact numerics, sliding windows": ("sliding-window layers", transformers.MistralConfig(), r"sliding-window"),
    "exact numerics, soft-capping": ("attention soft-capping", transformers.Gemma2Config(
        num_hidden_layers=2, layer_types=["full_attention"] * 2), r"soft-capping"),
}


def _refused(cfg, match: str) -> None:
    # vLLM is not in this venv: the engine's own check would speak first, so exact mode's is asked alone
    check = check_numerics if cfg.generator.engine == "vllm" and cfg.model.numerics == "exact" else build
    with pytest.raises(ValueError, match=match):
        check(cfg)


@pytest.mark.parametrize("name", REFUSALS)
def test_a_refusal_the_status_page_lists_is_raised(name):
    words, algo, sections, match = REFUSALS[name]
    assert words in STATUS, f"docs/status.md no longer says {words!r}"
    _refused(small_config(algo, **sections), match)


@pytest.mark.parametrize("name", MOE_REFUSALS)
def test_a_mixture_of_experts_refusal_the_status_page_lists_is_raised(name, tmp_path_factory):
    words, sections, match = MOE_REFUSALS[name]
    assert words in STATUS, f"docs/status.md no longer says {words!r}"
    moe = str(write_embedded_moe(tmp_path_factory.mktemp("moe") / "tiny"))
    _refused(small_config("grpo", **{"model": {"path": moe}, **sections}), match)


@pytest.mark.parametrize("name", MODEL_REFUSALS)
def test_an_architecture_the_status_page_lists_is_refused_by_exact_mode(name):
    words, config, match = MODEL_REFUSALS[name]
    assert words in STATUS, f"docs/status.md no longer says {words!r}"
    with pytest.raises(ValueError, match=match):
        numerics.check_model(config)
