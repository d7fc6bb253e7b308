"""tidal/common/host_memory.py: freed heap pages go back to the system, at a trim or at once."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tidal.common.host_memory import _libc

PROBE = r"""
import sys
import torch
from tidal.common.host_memory import map_large_blocks, trim_host_memory

def rss_mb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024

if sys.argv[1] == "mapped":
    map_large_blocks()
# glibc's default: a freed 16 MB block raises the mmap threshold to its size, and 4 MB blocks then come
# from the heap, like the transient copies of a model load
big = torch.ones(4 << 20)
del big
blocks = [torch.ones(1 << 20) for _ in range(100)]  # 400 MB, written
keep = blocks[-1]  # the heap's top stays in use: free() alone cannot shrink it
start = rss_mb()
del blocks
freed = rss_mb()
trim_host_memory()
print(start, freed, rss_mb())
"""


def _probe(mode: str) -> tuple[int, int, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                         check=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    start, freed, trimmed = map(int, out.stdout.split())
    return start, freed, trimmed


@pytest.mark.skipif(_libc() is None, reason="glibc's malloc_trim and mallopt: another C library")
def test_freed_heap_blocks_stay_resident_until_a_trim_or_go_back_at_once_when_mapped():
    start, freed, trimmed = _probe("default")
    assert start - freed < 50 and freed - trimmed > 300, (start, freed, trimmed)  # 396 MB held until the trim
    start, freed, trimmed = _probe("mapped")
    assert start - freed > 300, (start, freed, trimmed)  # map_large_blocks: back at the free
