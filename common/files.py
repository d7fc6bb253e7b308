"""File helpers shared by the checkpoint writer, the HF saver and the sample logs."""
from __future__ import annotations

import json
import os
from pathlib import Path


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
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
