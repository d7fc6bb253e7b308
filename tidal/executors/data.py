"""Prompt datasets: load JSONL/Parquet rows, tokenize once, hand out the prompts of each step.

The prompt at index i of step k depends only on (seed, k, i) (docs/architecture.md "The step", 1), so a resumed run,
a different schedule or a different number of generator ranks sees exactly the same prompts.
Indices 0..B-1 are the step's B prompts, from one seeded walk; dynamic sampling's top-ups
(indices B, B+1, ...) come from a second walk in which every step owns its own fixed range, so a
step's top-ups never take the prompts of a later step.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

_JSONL_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    extras: dict  # every other column (e.g. `answer`), handed to the reward as `sample`
    # 1-based line of a JSONL file (row of a Parquet file), named by reward errors; None for the
    # embedded task. Not compared: it says where a row is, not what it is
    line: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Columns:
    """Which of a data file's columns are the prompt and the answer (DeepScaleR: `problem`, GSM8K:
    `question`); the answer reaches rewards as `sample["answer"]` whatever its column is called."""
    prompt: str = "prompt"
    answer: str = "answer"


def _row(obj: Any, *, where: str, columns: Columns, line: int) -> PromptRow:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
    key = columns.prompt
    prompt = obj.get(key)
    if key not in obj:
        raise ValueError(f"{where}: field {key!r} is missing (the row has {', '.join(map(repr, list(obj)[:8]))}; "
                         f"data.prompt_key names the prompt's column)")
    if not isinstance(prompt, str):
        raise ValueError(f"{where}: field {key!r} is of type {type(prompt).__name__}, not a string")
    extras = {k: v for k, v in obj.items() if k != key}
    if columns.answer != "answer":  # named by the user: that column is the answer, never another one
        if columns.answer not in obj:
            raise ValueError(f"{where}: field {columns.answer!r} (data.answer_key) is missing (the row has "
                             f"{', '.join(map(repr, list(obj)[:8]))})")
        extras["answer"] = obj[columns.answer]
    return PromptRow(prompt=prompt, extras=extras, line=line)


def _load_jsonl(path: Path, columns: Columns) -> list[PromptRow]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():  # blank lines (a trailing newline, a separator) carry no row
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                # the line is parsed with its newline: an error past its text is "line 2" to json
                where = f"column {e.colno}" if e.lineno == 1 else "at the end of the line"
                raise ValueError(f"{path}:{line_no}: invalid JSON: {e.msg}, {where}") from e
            rows.append(_row(obj, where=f"{path}:{line_no}", columns=columns, line=line_no))
    return rows


def _load_parquet(path: Path, columns: Columns) -> list[PromptRow]:
    import pyarrow.parquet as pq  # only Parquet users pay for the import

    table = pq.read_table(path)
    return [_row(obj, where=f"{path}: row {i}", columns=columns, line=i)
            for i, obj in enumerate(table.to_pylist(), start=1)]


def load_prompts(path: str, columns: Columns = Columns()) -> list[PromptRow]:
    """Rows of a `.jsonl`/`.json` (one object per line) or `.parquet` file with a prompt column."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompt file {path!r} does not exist")
    if p.suffix in _JSONL_SUFFIXES:
        rows = _load_jsonl(p, columns)
    elif p.suffix == ".parquet":
        rows = _load_parquet(p, columns)
    else:
        raise ValueError(f"prompt file {path!r}: unknown format {p.suffix!r}; use .jsonl, .json or .parquet")
    if not rows:
        raise ValueError(f"prompt file {path!r} has no rows")
    return rows


# The two walks over the prompts. The main walk's seed string is the one every earlier run used:
# changing it would change every batch, and the demo's reward curve with it.
_MAIN_WALK, _TOPUP_WALK = "tidal-prompts", "tidal-prompts-topup"


def _locate(step: int, index: int, *, batch_size: int, max_topups: int) -> tuple[str, int]:
    """(walk, position in that walk's endless stream of shuffled epochs) of prompt `index` of `step`.

    Each step owns positions [step*B, (step+1)*B) of the main walk and [step*max_topups,
    (step+1)*max_topups) of the top-up walk, whatever it asks for: no step can reach into another's.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if max_topups < 0:
        raise ValueError(f"max_topups must be >= 0, got {max_topups}")
    if not 0 <= index < batch_size + max_topups:
        raise ValueError(f"prompt index {index} of step {step} is outside 0..{batch_size + max_topups - 1} "
                         f"(batch_size={batch_size}, max_topups={max_topups})")
    if index < batch_size:
        return _MAIN_WALK, step * batch_size + index
    return _TOPUP_WALK, step * max_topups + (index - batch_size)


class PromptSet:
    """Tokenized prompts that fit `max_prompt_tokens`, walked in a seeded order, epoch by epoch."""

    def __init__(self, rows: list[PromptRow], *, tokenizer: Any, max_prompt_tokens: int,
                 apply_chat_template: bool, tools: list[dict] | None = None) -> None:
        """`tools`: JSON schemas the chat template writes into each prompt (a multi-turn environment's)."""
        if max_prompt_tokens <= 0:
            raise ValueError(f"max_prompt_tokens must be positive, got {max_prompt_tokens}")
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("apply_chat_template=True but the tokenizer has no chat template")
        self._items: list[tuple[PromptRow, list[int]]] = []
        # Prompts over max_prompt_tokens are dropped, never truncated: a cut question is a
        # different question, with a reward that no longer fits it.
        self.dropped = 0
        chat = _ChatForm.of(tokenizer, tools) if apply_chat_template else None
        for row in rows:
            ids = _tokenize(tokenizer, row.prompt, chat=chat)
            if len(ids) > max_prompt_tokens:
                self.dropped += 1
            else:
                self._items.append((row, ids))
        if not self._items:
            raise ValueError(f"all {len(rows)} prompts are longer than max_prompt_tokens={max_prompt_tokens}")
        self._perms: dict[tuple[str, int, int], list[int]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def _perm(self, *, walk: str, seed: int, epoch: int) -> list[int]:
        key = (walk, seed, epoch)
        if key not in self._perms:
            order = list(range(len(self._items)))
            # String seeds go through sha512 in `random`: stable across runs, platforms and versions.
            random.Random(f"{walk}:{seed}:{epoch}").shuffle(order)
            # a step spans a few epochs of each of the two walks; keep memory flat (a miss only
            # costs a reshuffle, never a different order)
            if len(self._perms) >= 8:
                self._perms.clear()
            self._perms[key] = order
        return self._perms[key]

    def at(self, position: int) -> tuple[PromptRow, list[int]]:
        """The prompt at `position` in file order (evaluation walks the set once, unshuffled)."""
        row, ids = self._items[position]
        return row, list(ids)

    def prompts(self, step: int, indices: Sequence[int], *, batch_size: int, seed: int,
                max_topups: int) -> list[tuple[int, PromptRow, list[int]]]:
        """Prompts `indices` of `step`, in the order asked, as (index in step, row, prompt token ids).

        Indices 0..batch_size-1 are the step's B prompts; indices from batch_size on are top-ups,
        at most `max_topups` per step (ValueError past that). Each prompt depends on (seed, step,
        index) alone, so a replica asking for its share gets the same prompts as one asking for all.
        """
        n = len(self._items)
        out = []
        for i in indices:
            walk, pos = _locate(step, i, batch_size=batch_size, max_topups=max_topups)
            row, ids = self._items[self._perm(walk=walk, seed=seed, epoch=pos // n)[pos % n]]
            out.append((i, row, list(ids)))  # a copy: callers may append response tokens
        return out


@dataclass(frozen=True)
class _ChatForm:
    """How the chat template writes a prompt: the `tools=` it is given, or, for a template that ignores
    them (SmolLM2's), a system message describing them. Probed once per prompt set, not per prompt."""
    tools: list[dict] | None = None
    system: str | None = None

    @classmethod
    def of(cls, tokenizer: Any, tools: list[dict] | None) -> "_ChatForm":
        if not tools:
            return cls()
        probe = [{"role": "user", "content": "x"}]
        if tokenizer.apply_chat_template(probe, tokenize=False, tools=tools) != \
                tokenizer.apply_chat_template(probe, tokenize=False):
            return cls(tools=tools)
        from tidal.executors.environments.toolcall import describe_tools

        return cls(system=describe_tools(tools))


def _tokenize(tokenizer: Any, prompt: str, *, chat: _ChatForm | None) -> list[int]:
    if chat is None:
        return list(tokenizer(prompt)["input_ids"])
    messages = [{"role": "system", "content": chat.system}] if chat.system else []
    text = tokenizer.apply_chat_template([*messages, {"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False, **({"tools": chat.tools} if chat.tools else {}))
    # The template already writes BOS/special tokens; adding them again would double BOS.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
