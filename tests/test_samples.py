"""Rank 0's console sample, read back from samples.jsonl while the trainer appends to it."""
from __future__ import annotations

import json

from tidal.controller.samples import console_line, first_sample


def _row(step, index, sample, **kw):
    return {"step": step, "prompt_index": index, "sample": sample, "prompt": "p  \n q", "response": "r" * 300,
            "reward": 0.5, "advantage": -1.25, "length": 8, "finished": False, **kw}


def test_first_sample_reads_on_from_its_offset(tmp_path):
    path = tmp_path / "samples.jsonl"
    assert first_sample(path, 0, 0) == (None, 0)  # nothing written yet
    rows = [_row(0, 1, 0), _row(0, 0, 3), _row(0, 0, 2)]  # a second dp unit's lines may come first
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 1, "prompt')  # a line half written
    best, offset = first_sample(path, 0, 0)
    assert (best["prompt_index"], best["sample"]) == (0, 2)
    assert offset == len("".join(json.dumps(r) + "\n" for r in rows).encode())
    with open(path, "a") as f:
        f.write('_index": 0, "sample": 0}\n')
    assert first_sample(path, 0, offset)[0] is None  # step 0's lines were read already
    with open(path, "w") as f:  # the half line, completed
        f.write("".join(json.dumps(r) + "\n" for r in rows) + json.dumps(_row(1, 0, 0)) + "\n")
    best, _ = first_sample(path, 1, offset)
    assert (best["step"], best["prompt_index"]) == (1, 0)


def test_a_later_steps_lines_wait_for_their_step(tmp_path):
    """Periodic: the trainer may append step 1's samples before the console shows step 0; they are
    kept for step 1 (CI once printed two samples for three steps)."""
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [_row(0, 0, 1), _row(1, 0, 0), _row(1, 1, 0)]))
    best, offset = first_sample(path, 0, 0)
    assert (best["step"], best["sample"]) == (0, 1) and offset == len(json.dumps(_row(0, 0, 1))) + 1
    best, offset = first_sample(path, 1, offset)
    assert (best["step"], best["prompt_index"]) == (1, 0) and offset == path.stat().st_size


def test_console_line_is_short_and_names_the_sample():
    text = console_line(_row(3, 0, 0), width=40)
    head, prompt, response = text.splitlines()
    assert head == "sample (prompt 0, reward 0.5, advantage -1.25, 8 tokens, unfinished):"
    assert prompt == "  prompt:   p q" and response == "  response: " + "r" * 37 + "..."


def test_sample_lines_write_float32_values_short(tmp_path):
    """A float32 tensor's 0.1 is written 0.1 (not 0.10000000149011612) and reads back to the same float32;
    a reward function's own float64 keeps every digit."""
    import numpy as np
    import torch

    from tidal.common.files import append_jsonl

    rewards = torch.tensor([0.1, -1.25, 2 / 3], dtype=torch.float32)
    rows = [{"reward": float(r), "rewards": {"fn": [1 / 3, float(r)]}, "length": 8} for r in rewards]
    append_jsonl(tmp_path / "samples.jsonl", rows)
    text = (tmp_path / "samples.jsonl").read_text()
    assert text.splitlines()[0] == '{"reward": 0.1, "rewards": {"fn": [0.3333333333333333, 0.1]}, "length": 8}'
    assert '"reward": 0.6666667,' in text
    back = [json.loads(line)["reward"] for line in text.splitlines()]
    assert [np.float32(v) for v in back] == rewards.tolist()
