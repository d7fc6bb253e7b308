"""File helpers shared by the checkpoint writer and the HF saver."""
from __future__ import annotations

import os
from pathlib import Path


def readable_as_umask(path: Path) -> None:
    """Give a file the mode a plain open() would: some writers (safetensors) create files 0600, which
    keeps the group that shares a run directory from loading them."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
