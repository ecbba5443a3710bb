"""CPU memory-allocator settings that keep big temporaries out of the kernel's page-fault path.

glibc serves allocations above its mmap threshold with fresh `mmap`s, and returns freed heap tops above its trim
threshold to the kernel; both make every large temporary (vocabulary logits, MLP activations) page-fault anew, which
showed up as system time in training (docs/benchmarks.md). We pin the mmap threshold at its maximum (32 MiB, so it
no longer adapts) and keep freed heap memory, so temporaries below 32 MiB are recycled from the heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's upper limit for M_MMAP_THRESHOLD on 64-bit
# Chunks of vocabulary logits are sized to stay below the threshold (several such blocks live at once).
CPU_BLOCK_BYTES = 24 << 20
_done = False


def tune_malloc() -> bool:
    """Apply the settings once per process (glibc only; a no-op elsewhere). Returns whether they were applied."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        ok = bool(libc) and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.debug("mallopt unavailable (not glibc?); allocator left as is")
    _done = ok
    return ok
