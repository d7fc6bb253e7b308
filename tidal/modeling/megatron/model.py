"""megatron-core's GPTModel (local layer spec: no Transformer Engine, no Apex) built from an HF config,
with the HF weights converted in."""
from __future__ import annotations

import torch

from tidal.modeling.megatron.convert import Layout, shard, to_megatron


def check_supported(config) -> None:
    """A ValueError naming what this backend cannot convert or build for `config` (config.json alone)."""
    Layout.of(config)
    _rope_theta(config)


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"trainer.backend=megatron: rope scaling {params.get('rope_type')!r} is not supported yet")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def transformer_config(config, *, tp: int, pp: int = 1, dtype: torch.dtype = torch.float32):
    from megatron.core.transformer.transformer_config import TransformerConfig

    lay = Layout.of(config)
    # every fusion off: the fused kernels are CUDA-only, and the unfused path is what equals HF
    return TransformerConfig(
        num_layers=lay.layers, hidden_size=config.hidden_size, num_attention_heads=lay.heads,
        num_query_groups=lay.groups, kv_channels=lay.head_dim, ffn_hidden_size=config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=config.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=lay.qkv_bias,
        qk_layernorm=lay.qk_norm, hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        use_cpu_initialization=True, params_dtype=dtype, pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype if pp > 1 else None,
        # bf16 weights: attention's softmax in fp32 (megatron's attention_softmax_in_fp32), as HF's eager/sdpa paths
        bf16=dtype == torch.bfloat16)


def build(config, *, tp: int = 1, pp: int = 1, stage: int = 0, groups=None, parallel_output: bool = True,
          dtype: torch.dtype = torch.float32):
    """A GPTModel with config's shape, on this rank's tensor-parallel part of pipeline stage `stage` of
    pp (the embedding on the first, the final norm and head on the last: tidal/modeling/megatron/stages.py). groups: a
    ProcessGroupCollection (tidal/modeling/megatron/groups.py) whose tp group has tp ranks; None: megatron's
    own parallel_state. parallel_output: logits stay vocab-sharded (for a vocab-parallel
    log-softmax); False gathers them whole. dtype: the parameters' (bf16 also runs attention's
    softmax in fp32)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    lay = Layout.of(config)
    spec = get_gpt_layer_local_spec(qk_layernorm=lay.qk_norm, normalization="RMSNorm")
    return GPTModel(config=transformer_config(config, tp=tp, pp=pp, dtype=dtype), transformer_layer_spec=spec,
                    vocab_size=config.vocab_size, max_sequence_length=config.max_position_embeddings,
                    share_embeddings_and_output_weights=lay.tied, position_embedding_type="rope",
                    rotary_base=_rope_theta(config), parallel_output=parallel_output, pg_collection=groups,
                    pre_process=stage == 0, post_process=stage == pp - 1)


def load_hf(model, hf_state: dict[str, torch.Tensor], config, *, tp: int, rank: int, pp: int = 1,
            stage: int = 0) -> None:
    """Copy an HF state dict into a built GPTModel's part (tp rank `rank` of pipeline stage `stage`);
    every weight must land."""
    from tidal.modeling.megatron.stages import stage_part

    lay = Layout.of(config)
    mine = stage_part(shard(to_megatron(hf_state, lay), lay, tp=tp, rank=rank), layers=lay.layers, pp=pp,
                      stage=stage, tied=lay.tied)
    missing, unexpected = model.load_state_dict(mine, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)
