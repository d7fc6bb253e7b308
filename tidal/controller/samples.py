"""Rank 0's console: one sample per step, read back from samples.jsonl (the trainer writes it)."""
from __future__ import annotations

import json
from pathlib import Path


def first_sample(path: Path, step: int, offset: int) -> tuple[dict | None, int]:
    """The lowest (prompt, sample) line of `step` among the lines past byte `offset`, and the new
    offset (rank 0's console shows one sample per step without re-reading the file)."""
    if not path.is_file():
        return None, offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    best, used = None, 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # a line being written is read next time
        row = json.loads(line)
        if row["step"] > step:
            break  # a later step's lines (periodic: the trainer may be ahead of the console) wait for it
        used += len(line)
        if row["step"] == step and (best is None or (row["prompt_index"], row["sample"]) <
                                    (best["prompt_index"], best["sample"])):
            best = row
    return best, offset + used


def console_line(row: dict, *, width: int = 160) -> str:
    """One sample as the console shows it under the step's metrics."""
    def short(text: str, n: int) -> str:
        text = " ".join(text.split())
        return text if len(text) <= n else text[:n - 3] + "..."

    head = (f"sample (prompt {row['prompt_index']}, reward {row['reward']:.3g}, advantage {row['advantage']:.3g}, "
            f"{row['length']} tokens{'' if row['finished'] else ', unfinished'}):")
    if "turns" not in row:
        return f"{head}\n  prompt:   {short(row['prompt'], width)}\n  response: {short(row['response'], width)}"
    # a multi-turn sample: who wrote what, a line per turn
    turns = [f"  {('model:' if t['role'] == 'assistant' else 'env:'):<10}{short(t['text'], width)}" for t in row["turns"]]
    return "\n".join([head, f"  prompt:   {short(row['prompt'], width)}", *turns])
