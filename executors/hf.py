"""Model and tokenizer loading shared by the generator and the trainer.

`path=None` means the embedded default (a ~1M-parameter Qwen3 over the shipped 512-token
tokenizer), so every test and the CPU quick-start run without any download.
"""
from __future__ import annotations

from pathlib import Path

from typing import TYPE_CHECKING

import safetensors.torch
import torch
import transformers  # a lazy module: the heavy model code loads on first attribute use

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config

from executors.embedded import EOS_TOKEN, TOKENIZER_FILE

# sdpa: the kernel the trainer's explicit-mask (shared-prompt) path uses too. Measured on the
# embedded model: eager gives the same samples (log-probs within 1e-6) and no speed gain on CPU.
ATTN_IMPL = "sdpa"


def embedded_config(*, vocab_size: int, eos_token_id: int) -> Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )


def _check_dir(path: str) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ValueError(f"no Hugging Face model directory at {path!r} (expected {p / 'config.json'})")
    return p


def load_model(path: str | None, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> PreTrainedModel:
    """An HF causal LM from a local directory, or the embedded tiny Qwen3 initialised from `seed`."""
    if path is not None:
        _check_dir(path)
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, attn_implementation=ATTN_IMPL
        )
    tok = load_tokenizer(None)
    config = embedded_config(vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    config._attn_implementation = ATTN_IMPL
    # fork_rng: seed the init without disturbing the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype)


def load_config(path: str | None) -> transformers.PretrainedConfig:
    """The model's config alone (no weights): what placement checks need."""
    if path is not None:
        return transformers.AutoConfig.from_pretrained(_check_dir(path), local_files_only=True)
    tok = load_tokenizer(None)
    return embedded_config(vocab_size=len(tok), eos_token_id=tok.eos_token_id)


def load_tokenizer(path: str | None) -> PreTrainedTokenizerFast:
    """A fast tokenizer from a local directory, or the embedded 512-token byte-level BPE."""
    if path is not None:
        _check_dir(path)
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    # Left padding: batched prompts must end at the same column so decoding appends in lockstep.
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_FILE), eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, padding_side="left"
    )


def save_hf(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: str | Path, *,
            state: dict[str, torch.Tensor] | None = None) -> None:
    """Write a directory that `load_model(out_dir)` / `AutoModelForCausalLM.from_pretrained` read back.

    state: the full tensors to write, tied ones once (`executors.parallel.full_state_dict`, which
    a sharded model's ranks call together); default: the model's own.
    """
    from executors.parallel import full_state_dict  # torch.distributed.tensor: only when saving

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Not model.save_pretrained: under torch.distributed, transformers writes only on global rank 0,
    # and the trainer is rarely rank 0. Tied tensors are stored once under their first name in
    # state_dict order (as HF does), so the file is byte-identical for identical weights.
    # `architectures` names the model class: vLLM picks its own implementation by it (without it,
    # a slow generic fallback), and from_pretrained needs no model_type guess
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    if state is None:
        state = full_state_dict(model, keep=True)
    safetensors.torch.save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
