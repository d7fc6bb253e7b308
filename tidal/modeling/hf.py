"""Model and tokenizer loading shared by the generator and the trainer.

`path=None` means the embedded default (a ~1M-parameter Qwen3 over the shipped 512-token
tokenizer), so every test and the CPU quick-start run without any download.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
import torch
import transformers  # a lazy module: the heavy model code loads on first attribute use

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config

from tidal.common.files import readable_as_umask
from tidal.modeling.tiny import EOS_TOKEN, MODEL_SIZES, TOKENIZER_FILE

# sdpa: the kernel the trainer's explicit-mask (shared-prompt) path uses too. Measured on the
# embedded model: eager gives the same samples (log-probs within 1e-6) and no speed gain on CPU.
ATTN_IMPL = "sdpa"


def embedded_config(*, vocab_size: int, eos_token_id: int) -> Qwen3Config:
    return transformers.Qwen3Config(
        **{**MODEL_SIZES, "vocab_size": vocab_size},
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )


# What from_pretrained reads, in the names it looks for (a sharded checkpoint: an index + shards).
WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
TOKENIZER_FILES = "tokenizer.json, or tokenizer_config.json with tokenizer.model or vocab.json"


def _check_dir(path: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"no Hugging Face model directory at {path!r} (no such directory)")
    if not (p / "config.json").is_file():
        raise ValueError(f"no Hugging Face model directory at {path!r} (expected {p / 'config.json'})")
    return p


def check_weights(path: str) -> None:
    """A weights file is there, and every shard its index names (without them from_pretrained fails
    only after the model is built, or initialises the missing tensors at random)."""
    p = _check_dir(path)
    found = [name for name in WEIGHTS_FILES if (p / name).is_file()]
    if not found:
        raise ValueError(f"model directory {path!r} has no weights (looked for {', '.join(WEIGHTS_FILES)})")
    if not found[0].endswith(".index.json"):
        return
    try:
        shards = set(json.loads((p / found[0]).read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{p / found[0]} is not a weights index ({type(exc).__name__}: {exc})") from None
    missing = sorted(name for name in shards if not (p / name).is_file())
    if missing:
        raise ValueError(f"model directory {path!r}: shard {missing[0]} named in {found[0]} is missing"
                         + (f" ({len(missing)} shards missing)" if len(missing) > 1 else ""))


def check_tokenizer(path: str) -> None:
    """Tokenizer files are there: without them AutoTokenizer may still build one that encodes
    every prompt to nothing (seen as `empty prompt` far from the cause)."""
    p = Path(path)
    if (p / "tokenizer.json").is_file():
        return
    if (p / "tokenizer_config.json").is_file() and any((p / n).is_file() for n in ("tokenizer.model", "vocab.json")):
        return
    raise ValueError(f"model directory {path!r} has no tokenizer (looked for {TOKENIZER_FILES})")


def check_model_dir(path: str) -> None:
    """Everything a run reads from a model directory, read but not loaded: the launcher checks it
    before any rank starts, where a bad directory costs one line instead of a start-up."""
    config = _check_dir(path) / "config.json"
    try:
        parsed = json.loads(config.read_text())
    except ValueError as exc:  # UnicodeDecodeError included
        raise ValueError(f"{config} is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{config} is not a JSON object (got {type(parsed).__name__})")
    check_weights(path)
    check_tokenizer(path)


def in_own_memory(model: PreTrainedModel) -> PreTrainedModel:
    """Copy every parameter and buffer out of the weights file it was loaded from, in place.

    from_pretrained leaves CPU tensors as views of the mmapped safetensors file, at the file's offsets
    (16-byte aligned, seen: 16 and 48 mod 64); the CPU kernels take other code paths on such memory
    than on the allocator's 64-byte-aligned tensors, and round differently (seen: 6e-8 on a value).
    A run resumed from a checkpoint must compute the same bits as the run that kept its weights in
    memory, so loaded weights get memory of their own."""
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            t.data = t.data.clone()
    return model


def quiet_loading() -> None:
    """transformers' "Loading weights" bar: every rank that holds a model draws it, and a log that is no
    terminal gets each redraw as a fragment; so it is drawn on global rank 0's terminal only. Only the
    bars go: transformers' warnings and errors still print on every rank."""
    if os.environ.get("RANK", "0") != "0" or not sys.stderr.isatty():
        transformers.utils.logging.disable_progress_bar()


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` with its parameters in `dtype` and its buffers as they were, in place. `Module.to`
    would also round RoPE's inv_freq buffer to bf16, which from_pretrained(dtype=bf16) keeps in
    float32: measured on SmolLM2-135M, a bf16 inv_freq on one side only made the bf16 trainer's first
    layer differ from the generator's as much as bf16 differs from fp32 (bench/bf16_gap.py). FSDP2's
    mixed precision casts parameters only, so this is also what the FSDP layout computes with."""
    buffers = dict(model.named_buffers())
    model.to(dtype)
    for name, buf in buffers.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = buf
    return model


def load_model(path: str | None, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> PreTrainedModel:
    """An HF causal LM from a local directory, or the embedded tiny Qwen3 initialised from `seed`."""
    if path is not None:
        check_weights(path)
        quiet_loading()
        return in_own_memory(transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, attn_implementation=ATTN_IMPL))
    tok = load_tokenizer(None)
    config = embedded_config(vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    config._attn_implementation = ATTN_IMPL
    # fork_rng: seed the init without disturbing the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return cast_parameters(model, dtype)


def load_config(path: str | None) -> transformers.PretrainedConfig:
    """The model's config alone (no weights): the facts the checks before any rank starts ask, from every
    section's check (tidal/recipes/checks.py, the engines' and backends' own), so it is loaded once per
    version of config.json. Shared: read it, never change it."""
    try:
        stamp = Path(path, "config.json").stat().st_mtime_ns if path else None
    except OSError:  # tidal/launch/preflight.py names a missing config.json; _check_dir says it here otherwise
        stamp = None
    return _load_config(path, stamp)


@functools.lru_cache(maxsize=4)
def _load_config(path: str | None, stamp: int | None) -> transformers.PretrainedConfig:
    if path is not None:
        return transformers.AutoConfig.from_pretrained(_check_dir(path), local_files_only=True)
    tok = load_tokenizer(None)
    return embedded_config(vocab_size=len(tok), eos_token_id=tok.eos_token_id)


def _bare_config(path: str) -> transformers.PretrainedConfig:
    """config.json as a generic config. AutoTokenizer reads the model type (for per-model fixes) and
    would otherwise load the model's own config class, which imports transformers' whole model stack:
    1.3-1.6 s measured, paid by the reward ranks, which need only the tokenizer."""
    try:
        fields = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        fields = {}
    known = {k: fields[k] for k in ("model_type", "tokenizer_class") if isinstance(fields.get(k), str)}
    return transformers.PretrainedConfig(**known)


def load_tokenizer(path: str | None) -> PreTrainedTokenizerFast:
    """A fast tokenizer from a local directory, or the embedded 512-token byte-level BPE."""
    if path is not None:
        _check_dir(path)
        check_tokenizer(path)
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, config=_bare_config(path))
    # Left padding: batched prompts must end at the same column so decoding appends in lockstep.
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_FILE), eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, padding_side="left"
    )


def save_hf(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: str | Path, *,
            state: dict[str, torch.Tensor] | None = None) -> None:
    """Write a directory that `load_model(out_dir)` / `AutoModelForCausalLM.from_pretrained` read back.

    state: the full tensors to write, tied ones once (`tidal.modeling.parallel.full_state_dict`, which
    a sharded model's ranks call together); default: the model's own.
    """
    from tidal.modeling.parallel import full_state_dict  # torch.distributed.tensor: only when saving

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
    readable_as_umask(out / "model.safetensors")
    tokenizer.save_pretrained(out)
