"""Defaults that depend on what is loaded, and where each value of a run came from.

The classes' defaults are tuned for the embedded task (a 1M-parameter model trained from scratch:
lr 1e-3, 8-token answers). A pretrained `model.path` gets RL fine-tuning defaults instead, where
the user left a value unset: lr 1e-6 with a short warm-up (TRL's and verl's GRPO defaults; 1e-3
wrecked a 135M instruct model in one step), TRL's prompt/completion lengths, 16 decode slots for
the native engine (the embedded job's 2 would leave a real model's batch nearly empty), and the tokenizer's
chat template when it has one. KL stays off (beta 0) and grad_clip 1.0, as for the embedded task.
"""
from __future__ import annotations

import json
from pathlib import Path

PRETRAINED: dict[str, object] = {
    "trainer.lr": 1e-6,
    "trainer.warmup_steps": 10,
    "generator.max_new_tokens": 256,
    "generator.max_batch_prompts": 16,
    "data.max_prompt_tokens": 512,
}
# a value model's decoder is pretrained but its head is new: verl's and OpenRLHF's critic lr is ~10x the actor's
PRETRAINED_CRITIC: dict[str, object] = {
    "critic.lr": 1e-5,
    "critic.warmup_steps": 10,
}
PRETRAINED_SOURCE = "pretrained default"


def flatten(data: dict, prefix: str = "") -> dict[str, object]:
    """{"trainer": {"lr": 1}} -> {"trainer.lr": 1}; lists and scalars are leaves."""
    out: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict):  # an empty section sets nothing
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _is_set(data: dict, dotted: str) -> bool:
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _put(data: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[leaf] = value


def _has_chat_template(model_path: str) -> bool:
    """A tokenizer with a chat template is an instruct/chat model's: its prompts want the template.
    An unreadable file is preflight's to report, so it counts as no template here."""
    d = Path(model_path)
    try:
        if json.loads((d / "tokenizer_config.json").read_text()).get("chat_template"):
            return True
    except (OSError, ValueError):
        pass
    return (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file()


def pretrained_defaults(data: dict, *, critic: bool = False) -> dict[str, object]:
    """The values a pretrained model.path gets for what `data` (file + --set + flags) leaves unset;
    critic: the algorithm trains a value model too (its section's values are listed only then)."""
    model_path = (data.get("model") or {}).get("path") if isinstance(data.get("model"), dict) else None
    if not model_path:
        return {}
    chosen = dict(PRETRAINED) | (dict(PRETRAINED_CRITIC) if critic else {})
    if _has_chat_template(str(model_path)):
        chosen["data.chat_template"] = True
    return {key: value for key, value in chosen.items() if not _is_set(data, key)}


def apply(data: dict, defaults: dict[str, object]) -> None:
    for key, value in defaults.items():
        _put(data, key, value)


def sources(resolved: dict, layers: list[tuple[str, dict]]) -> dict[str, str]:
    """Where each leaf of the resolved config came from: the last layer (lowest first) that set it or
    a section holding it, else "default". layers: (name, the values it set, nested or dotted)."""
    flat_layers = [(name, set(flatten(values))) for name, values in layers]
    out = {}
    for key in flatten(resolved):
        source = "default"
        prefixes = {key} | {key.rsplit(".", n)[0] for n in range(1, key.count(".") + 1)}
        for name, keys in flat_layers:
            if keys & prefixes:
                source = name
        out[key] = source
    return out
