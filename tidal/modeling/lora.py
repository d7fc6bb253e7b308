"""LoRA: the trainer trains low-rank adapters on a frozen base (`trainer.lora`), via peft.

The adapters are injected into the HF model in place (peft's `inject_adapter_in_model`): the model
keeps its class and every path that runs it (packing, the chunked head) runs it unchanged. Each
targeted Linear computes base(x) + B·A·x · alpha/rank, with B = 0 at the start, so the first step
samples with the base model's bits.
- The optimizer holds the adapters only (they alone require grad), so its state and the gradient
  accumulators are the adapters' size.
- The reference is the base itself: the policy with its adapters switched off (`adapters_disabled`),
  no second copy of the model.
- The WEIGHTS push carries the adapter tensors alone: the generator holds the same adapters (the
  same injection) and applies them as the same low-rank add.
- Checkpoints and final/ hold the adapter in PEFT's format (adapter_config.json and
  adapter_model.safetensors: `PeftModel.from_pretrained(base, path)` reads it); with
  trainer.lora.merged also final/merged/, the base with the adapters merged, as a plain HF model.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_FILE = "adapter_model.safetensors"  # beside it, adapter_config.json (peft writes it)
_PEFT_PREFIX = "base_model.model."  # PeftModel's names of the model's modules in its files


class LoraConfig(BaseModel):
    """trainer.lora: off at rank 0."""

    model_config = ConfigDict(extra="forbid")
    rank: int = Field(0, ge=0, description="adapter rank r; 0: no LoRA, the whole model trains")
    alpha: float = Field(16.0, gt=0, description="the adapters' scale is alpha / rank")
    target_modules: list[str] | None = Field(
        None, description="the Linear modules (by name, e.g. [q_proj, v_proj]) that get adapters; default: every "
        "one of q/k/v/o_proj and gate/up/down_proj the model has (an MoE model's experts are not Linear modules)")
    merged: bool = Field(False, description="also write final/merged: the base with the adapters merged into "
                         "its weights, a plain HF model directory")

    @property
    def on(self) -> bool:
        return self.rank > 0

    def peft(self, modules: list[str]):
        """peft's config for these modules (full names: peft would otherwise map gate/up/down_proj onto an
        MoE model's fused experts with adapters of its own kind)."""
        from peft import LoraConfig as PeftLora

        # dropout 0: the generator's forward has none, so the trainer must not either (on-policy)
        return PeftLora(r=self.rank, lora_alpha=self.alpha, target_modules=modules, lora_dropout=0.0, bias="none")


def targets(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """The full names of the Linear modules `cfg` targets; ValueError naming a target the model lacks."""
    linear = {name: name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    wanted = cfg.target_modules if cfg.target_modules is not None else ALL_LINEAR
    missing = [t for t in cfg.target_modules or () if t not in linear.values()]
    if missing or not any(short in wanted for short in linear.values()):
        raise ValueError(f"trainer.lora.target_modules: {', '.join(map(repr, missing or wanted))} "
                         f"{'is' if len(missing) == 1 else 'are'} not a Linear module of this model (model_type "
                         f"{model.config.model_type!r}; its Linear modules: {', '.join(sorted(set(linear.values())))})")
    return [name for name, short in linear.items() if short in wanted and short != "lm_head"]


def apply_lora(model: nn.Module, cfg: LoraConfig, *, seed: int) -> nn.Module:
    """Inject `cfg`'s adapters into `model` in place; only they require grad from here on. A's random
    init comes from `seed` alone, not from whatever the process drew before (a co-located run draws
    its generator's first), so every placement starts from the same adapters."""
    from peft import inject_adapter_in_model

    modules = targets(model, cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return inject_adapter_in_model(cfg.peft(modules), model)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if is_adapter(name)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The base model: every adapter of `model` off inside."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def save_adapter(model: nn.Module, cfg: LoraConfig, path: Path, *, base: str | None) -> None:
    """The adapters of `model` in PEFT's format at `path` (a directory)."""
    save_state(adapter_params(model), cfg, path, base=base)


def save_state(adapters: Mapping[str, torch.Tensor], cfg: LoraConfig, path: Path, *, base: str | None = None) -> None:
    """Adapter tensors under the model's names (`...q_proj.lora_A.default.weight`: the trainer's, or a
    push's) in PEFT's format at `path`: PeftModel's names, and the modules they adapt."""
    import safetensors.torch

    path.mkdir(parents=True, exist_ok=True)
    state = {_PEFT_PREFIX + name.replace(".default.", "."): t.detach().contiguous().cpu() for name, t in adapters.items()}
    safetensors.torch.save_file(state, str(path / ADAPTER_FILE), metadata={"format": "pt"})
    peft_cfg = cfg.peft(sorted({name.split(".lora_")[0] for name in adapters}))
    peft_cfg.base_model_name_or_path = base
    peft_cfg.task_type = "CAUSAL_LM"
    peft_cfg.save_pretrained(str(path))


def load_adapter(model: nn.Module, path: Path) -> None:
    """The adapters saved at `path` (save_adapter's, or PeftModel.save_pretrained's) into `model`."""
    import safetensors.torch
    from peft import set_peft_model_state_dict

    state = safetensors.torch.load_file(str(path / ADAPTER_FILE))
    result = set_peft_model_state_dict(model, {k.removeprefix(_PEFT_PREFIX): v for k, v in state.items()})
    missing = [k for k in result.missing_keys if is_adapter(k)]
    assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base's state dict with each adapter merged into its weight, under the HF names (CPU)."""
    from peft.tuners.lora import LoraLayer

    merged = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):
                delta = module.get_delta_weight("default")
                merged[f"{name}.weight"] = (module.base_layer.weight + delta.to(module.base_layer.weight.dtype))
        first = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
        out = {}
        for key, value in model.state_dict().items():
            if key not in first or is_adapter(key):
                continue
            name = key.replace(".base_layer.", ".")
            out[name] = merged.get(name, value).detach().contiguous().cpu()
    return out


def check_targets(config, cfg: LoraConfig) -> None:
    """Every target module is a Linear of the model (built on the meta device from its config)."""
    import transformers

    with torch.device("meta"):
        targets(transformers.AutoModelForCausalLM.from_config(config), cfg)
