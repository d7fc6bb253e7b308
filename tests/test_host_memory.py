"""common/host_memory.py: freed heap pages go back to the system when asked."""
from __future__ import annotations

import subprocess
import sys

import pytest

from common.host_memory import _malloc_trim

PROBE = r"""
import torch
from common.host_memory import trim_host_memory

def rss_mb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024

# a freed 16 MB block raises glibc's mmap threshold to its size: 4 MB blocks then come from the heap,
# like the transient copies of a model load
big = torch.ones(4 << 20)
del big
blocks = [torch.ones(1 << 20) for _ in range(100)]  # 400 MB on the heap, written
keep = blocks[-1]  # the heap's top stays in use: free() alone cannot shrink it
del blocks
before = rss_mb()
trim_host_memory()
print(before, rss_mb())
"""


@pytest.mark.skipif(_malloc_trim() is None, reason="glibc's malloc_trim: another C library")
def test_a_trim_gives_the_heap_pages_of_freed_blocks_back():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    before, after = map(int, out.stdout.split())
    assert before - after > 300, (before, after)  # of the 396 MB freed: resident until the trim
