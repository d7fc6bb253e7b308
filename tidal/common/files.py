"""File helpers shared by the checkpoint writer, the HF saver and the sample logs."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np


def readable_as_umask(path: Path) -> None:
    """Give a file the mode a plain open() would: some writers (safetensors) create files 0600, which
    keeps the group that shares a run directory from loading them."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def append_jsonl(path: Path, rows: list[dict]) -> None:
    """Append `rows` as JSON lines in one O_APPEND write: ranks appending to one file never split
    each other's lines."""
    if not rows:
        return
    data = "".join(json.dumps(short_floats(row)) + "\n" for row in rows).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


_F32_MAX = float(np.finfo(np.float32).max)


def short_float(x: float) -> float:
    """A float that is exactly a float32 (a tensor's value: rewards, advantages) as the shortest decimal
    that reads back to that float32: 0.1, not 0.10000000149011612. Other floats (a reward function's
    own float64, e.g. 1/3) keep every digit: shortening them would change the value."""
    if not math.isfinite(x) or abs(x) > _F32_MAX or float(np.float32(x)) != x:
        return x
    return float(str(np.float32(x)))


def short_floats(value):
    """`value` with short_float applied to every float inside its dicts and lists."""
    if isinstance(value, float):
        return short_float(value)
    if isinstance(value, dict):
        return {k: short_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [short_floats(v) for v in value]
    return value
