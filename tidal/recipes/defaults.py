"""Defaults that depend on what is loaded, and where each value of a run came from.

The classes' defaults are tuned for the embedded task (a 1M-parameter model trained from scratch:
lr 1e-3, 8-token answers). A pretrained `model.path` gets RL fine-tuning defaults instead, where
the user left a value unset: lr 1e-6 with a short warm-up (TRL's and verl's GRPO defaults; 1e-3
wrecked a 135M instruct model in one step), TRL's prompt/completion lengths, and the tokenizer's chat template when it has one; its decode
slots are the launch's choice (tidal/launch/auto.py; decode_slots is the rule where nothing was measured). KL stays off (beta 0) and grad_clip 1.0, as for the embedded task.
"""
from __future__ import annotations

import json
from pathlib import Path

PRETRAINED: dict[str, object] = {
    "trainer.lr": 1e-6,
    "trainer.warmup_steps": 10,
    "generator.max_new_tokens": 256,
    "data.max_prompt_tokens": 512,
}
# a value model's decoder is pretrained but its head is new: verl's and OpenRLHF's critic lr is ~10x the actor's
PRETRAINED_CRITIC: dict[str, object] = {
    "critic.lr": 1e-5,
    "critic.warmup_steps": 10,
}
PRETRAINED_SECTIONS = {"critic": PRETRAINED_CRITIC}  # by the sections an advantage source trains (tidal/recipes/advantages.py)
PRETRAINED_SOURCE = "pretrained default"
# The sample rows a wave of decoding holds. A decode forward costs a fixed part (reading every
# weight) plus a part per row, and each wave pays the fixed part again. Measured on this CPU,
# SmolLM2-135M, one thread: 64 ms at 4 rows, 79 at 8, 111 at 16 (fixed ~48 ms, ~4 ms a row), so 2
# waves of 8 rows decode in 1.4x the time of 16 at once, 4 waves of 4 in 2.3x. On a GPU/NPU a
# decode forward is bound by reading the weights up to a few hundred rows: vLLM's default
# max_num_seqs, 256.
SATURATING_ROWS = {"cpu": 16, "gpu": 256}


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


def pretrained_defaults(data: dict, *, sections: tuple[str, ...] = ()) -> dict[str, object]:
    """The values a pretrained model.path gets for what `data` (file + --set + flags) leaves unset;
    sections: what the algorithm trains besides the policy (e.g. "critic", a value model: its section's
    values are listed only then)."""
    model_path = (data.get("model") or {}).get("path") if isinstance(data.get("model"), dict) else None
    if not model_path:
        return {}
    chosen = dict(PRETRAINED)
    for section in sections:
        chosen |= PRETRAINED_SECTIONS[section]
    if _has_chat_template(str(model_path)):
        chosen["data.chat_template"] = True
    return {key: value for key, value in chosen.items() if not _is_set(data, key)}


def decode_slots(*, prompts: int, samples: int, replicas: int, device_type: str, overlaps: bool = True) -> int:
    """Prompt groups a generator replica decodes at once, so that periodic mode overlaps.

    All groups of a replica decoding together reach the token cap together and leave at the end:
    the trainer waits for all of generation (a real model's run overlapped 0 s in 20 of 20 steps at
    16 slots). Fewer slots make waves: the first leaves after a fraction of generation and the
    trainer starts on it while the next waves decode. A wave costs the forwards' fixed part once
    more, so a wave holds about SATURATING_ROWS rows (where a row more is no longer nearly free);
    on CPU, where that is a few groups, a replica's prompts also make at least two waves.
    On a GPU/NPU a step of at most ~256 rows is one wave: splitting it would add a whole
    generation's time for an overlap that can only recover the training that waits, and response
    lengths that differ (the usual case) spread the groups' ends anyway.
    overlaps=False (the sync schedule, the co-located placement: training never runs beside
    generation): one wave, as on a GPU; two waves of Qwen2.5-0.5B's 4 rows took 1.61x one of 8 on CPU."""
    per_replica = -(-prompts // replicas)
    by_rows = max(1, SATURATING_ROWS["cpu" if device_type == "cpu" else "gpu"] // samples)
    if device_type == "cpu" and overlaps:
        return max(1, min(by_rows, -(-per_replica // 2)))
    return max(1, min(by_rows, per_replica))


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


PLACEMENT_SOURCE = "placement=colocated"


def placement_defaults(data: dict) -> dict[str, object]:
    """placement=colocated runs the sync schedule where the user chose none (tidal/controller/colocate.py),
    and the engine's own co-located defaults (its registry entry's) where the user set none."""
    from tidal.executors.generator.engines import ENGINES

    if data.get("placement") != "colocated":
        return {}
    engine = ENGINES.get((data.get("generator") or {}).get("engine") or "native")
    out = {"schedule.kind": "sync", **engine.colocated_defaults}
    return {key: value for key, value in out.items() if not _is_set(data, key)}
