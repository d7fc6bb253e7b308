"""The host memory a rank's peak counts: what the C allocator (glibc's) keeps after a free.

torch's CPU tensors come from malloc. glibc serves a block from a mapping of its own, returned to the
system at free, only above a threshold that starts at 128 KiB and rises to the size of each mapped
block freed, up to 32 MiB: after the first big free, a model's weights, a layer's activations and a
chunk of logits all come from the heap, whose freed pages stay resident and whose holes blocks of
other sizes do not fit. A rank whose phases allocate different shapes (a co-located rank: generate,
then train) then peaks at its live memory plus what earlier phases left in the heap. Two remedies,
both no-ops with another C library:
- `map_large_blocks` (each rank's start): a fixed 1 MiB threshold, so big blocks always go back;
- `trim_host_memory` (after the model loads and after each step): the heap's free pages go back.
Measured on Qwen2.5-Coder-0.5B co-located (fp32, B=2 x G=4 x 96 tokens, 3 steps, docs/benchmarks.md):
peak RSS 17.46 GiB as it was, 13.07 with the trims (the push still copying), 11.50 with the push's
handover, 10.28 with the fixed threshold too; step times 56-64 s in all of them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LARGE_BLOCK_BYTES = 1 << 20


@functools.cache
def _libc():
    """glibc, or None (another C library: neither remedy applies)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def map_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> None:
    """Serve every block of `threshold` bytes and more from a mapping of its own, returned at its free
    (glibc's threshold then stays fixed instead of rising to 32 MiB). A MALLOC_MMAP_THRESHOLD_ the
    user set wins."""
    if _libc() is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        _libc().mallopt(M_MMAP_THRESHOLD, threshold)


def trim_host_memory() -> None:
    """Give the C heap's free pages back to the system (glibc malloc_trim). A model loaded on the CPU
    leaves its transient copies (the checkpoint's dtype, then the cast) in the heap: Qwen2.5-Coder-0.5B
    in fp32, loaded twice in one process, 5.58 GB resident, 4.22 GB after a trim."""
    if _libc() is not None:
        _libc().malloc_trim(0)
