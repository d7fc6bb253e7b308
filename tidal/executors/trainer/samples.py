"""samples.jsonl: what the policy wrote, one line per sample, with what it was scored and taught.

Written by the trainer (the one executor that knows every sample's advantage): each dp unit's first
rank appends the groups it trained, once per logged step, in one O_APPEND write, so units never
interleave inside a line. A line: step, prompt index, sample index, prompt, response text, reward,
each reward function's score, advantage, length in tokens, finished (hit EOS).
"""
from __future__ import annotations

from pathlib import Path

import torch

from tidal.channels.payloads import ScoredGroup
from tidal.common.files import append_jsonl


def sample_rows(group: ScoredGroup, advantages_G: torch.Tensor, texts: list[str], tokenizer=None) -> list[dict]:
    """One line per sample; a multi-turn sample's also has `turns` (who wrote what: role, text, tokens),
    `model_tokens` (the trained ones) and `env_error` (its environment's failure, or null); with
    partial rollouts, `policy_versions`: [the oldest, the newest] version that wrote its tokens."""
    rows = []
    for j, (ids, text) in enumerate(zip(group.responses, texts)):
        row = {
            "step": group.step, "prompt_index": group.index, "sample": j, "prompt": group.prompt, "response": text,
            "reward": float(group.rewards[j]), "rewards": {name: s[j] for name, s in group.reward_parts.items()},
            "advantage": float(advantages_G[j]), "length": int(ids.numel()), "finished": bool(group.finished[j]),
        }
        if group.episodes is not None:
            row["turns"] = [{"role": role, "text": tokenizer.decode(part, skip_special_tokens=True),
                             "tokens": int(part.numel())} for role, part in group.turns(j)]
            row["model_tokens"] = group.model_tokens(j)
            row["env_error"] = group.episodes[j]["error"]
        if group.versions is not None and group.versions[j].numel():
            row["policy_versions"] = [int(group.versions[j].min()), int(group.versions[j].max())]
        rows.append(row)
    return rows


def append_samples(path: Path, groups: list[ScoredGroup], advantages: dict[int, torch.Tensor], tokenizer) -> None:
    """Lines for `groups` (in prompt-index order) with their advantages, appended in one write."""
    rows = []
    for group in sorted(groups, key=lambda g: g.index):
        texts = tokenizer.batch_decode(group.responses, skip_special_tokens=True)
        rows += sample_rows(group, advantages[group.index], texts, tokenizer)
    append_jsonl(path, rows)
