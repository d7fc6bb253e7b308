"""A tiny random-init Qwen3-MoE over the embedded tokenizer, written as an HF directory (config.json,
safetensors, tokenizer): the mixture-of-experts tests and bench/moe.py load it like any model."""
from __future__ import annotations

from pathlib import Path

from tidal.modeling.tiny import MODEL_SIZES

# the embedded Qwen3's attention and sizes; each MLP is 8 experts of 64 (2 per token: 128 active, as
# many MLP parameters per token as a dense model with intermediate_size 128)
MOE_SIZES = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
                 norm_topk_prob=True)


def write_embedded_moe(path: str | Path, *, seed: int = 0, **sizes) -> Path:
    """The tiny MoE initialised from `seed`, at `path`; `sizes` override MODEL_SIZES / MOE_SIZES."""
    import torch
    import transformers

    from tidal.modeling.hf import ATTN_IMPL, load_tokenizer, save_hf

    tok = load_tokenizer(None)
    config = transformers.Qwen3MoeConfig(**{**MODEL_SIZES, **MOE_SIZES, "vocab_size": len(tok), **sizes},
                                         bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.eos_token_id)
    config._attn_implementation = ATTN_IMPL
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    save_hf(model, tok, path)
    return Path(path)
