"""Prompt datasets: load JSONL/Parquet rows, tokenize once, hand out the B prompts of each step.

The batch of step k depends only on (seed, k) (DESIGN.md step 1), so a resumed run, a different
schedule or a different number of generator ranks sees exactly the same prompts.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_JSONL_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    extras: dict  # every other column (e.g. `answer`), handed to the reward as `sample`


def _row(obj: Any, *, where: str) -> PromptRow:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str):
        what = "missing" if "prompt" not in obj else f"of type {type(prompt).__name__}, not a string"
        raise ValueError(f"{where}: field 'prompt' is {what}")
    return PromptRow(prompt=prompt, extras={k: v for k, v in obj.items() if k != "prompt"})


def _load_jsonl(path: Path) -> list[PromptRow]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():  # blank lines (a trailing newline, a separator) carry no row
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: invalid JSON: {e}") from e
            rows.append(_row(obj, where=f"{path}:{line_no}"))
    return rows


def _load_parquet(path: Path) -> list[PromptRow]:
    import pyarrow.parquet as pq  # only Parquet users pay for the import

    table = pq.read_table(path)
    return [_row(obj, where=f"{path}: row {i}") for i, obj in enumerate(table.to_pylist(), start=1)]


def load_prompts(path: str) -> list[PromptRow]:
    """Rows of a `.jsonl`/`.json` (one object per line) or `.parquet` file with a `prompt` column."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompt file {path!r} does not exist")
    if p.suffix in _JSONL_SUFFIXES:
        rows = _load_jsonl(p)
    elif p.suffix == ".parquet":
        rows = _load_parquet(p)
    else:
        raise ValueError(f"prompt file {path!r}: unknown format {p.suffix!r}; use .jsonl, .json or .parquet")
    if not rows:
        raise ValueError(f"prompt file {path!r} has no rows")
    return rows


class PromptSet:
    """Tokenized prompts that fit `max_prompt_tokens`, walked in a seeded order, epoch by epoch."""

    def __init__(self, rows: list[PromptRow], *, tokenizer: Any, max_prompt_tokens: int,
                 apply_chat_template: bool) -> None:
        if max_prompt_tokens <= 0:
            raise ValueError(f"max_prompt_tokens must be positive, got {max_prompt_tokens}")
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("apply_chat_template=True but the tokenizer has no chat template")
        self._items: list[tuple[PromptRow, list[int]]] = []
        # Prompts over max_prompt_tokens are dropped, never truncated: a cut question is a
        # different question, with a reward that no longer fits it.
        self.dropped = 0
        for row in rows:
            ids = _tokenize(tokenizer, row.prompt, apply_chat_template=apply_chat_template)
            if len(ids) > max_prompt_tokens:
                self.dropped += 1
            else:
                self._items.append((row, ids))
        if not self._items:
            raise ValueError(f"all {len(rows)} prompts are longer than max_prompt_tokens={max_prompt_tokens}")
        self._perms: dict[tuple[int, int], list[int]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def _perm(self, *, seed: int, epoch: int) -> list[int]:
        key = (seed, epoch)
        if key not in self._perms:
            order = list(range(len(self._items)))
            # String seeds go through sha512 in `random`: stable across runs, platforms and versions.
            random.Random(f"tidal-prompts:{seed}:{epoch}").shuffle(order)
            if len(self._perms) >= 4:  # a step spans at most a few epochs; keep memory flat
                self._perms.clear()
            self._perms[key] = order
        return self._perms[key]

    def batch(self, step: int, *, batch_size: int, seed: int) -> list[tuple[int, PromptRow, list[int]]]:
        """The B prompts of `step` as (index in step, row, prompt token ids)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        n = len(self._items)
        out = []
        for i in range(batch_size):
            pos = step * batch_size + i  # position in the endless stream of shuffled epochs
            row, ids = self._items[self._perm(seed=seed, epoch=pos // n)[pos % n]]
            out.append((i, row, list(ids)))  # a copy: callers may append response tokens
        return out


def _tokenize(tokenizer: Any, prompt: str, *, apply_chat_template: bool) -> list[int]:
    if not apply_chat_template:
        return list(tokenizer(prompt)["input_ids"])
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    # The template already writes BOS/special tokens; adding them again would double BOS.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
