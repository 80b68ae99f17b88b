"""Give freed heap memory back to the operating system between phases.

A rollout allocates its KV cache as many ~15 MB tensors, an update its activations;
glibc keeps such freed blocks in its heap (its mmap threshold rises with the first large
free), so without a trim the resident set only ever grows: each phase's peak stacks on
the previous phase's leftovers. `malloc_trim(0)` returns every free page; it takes a few
milliseconds and is a no-op where glibc is not the allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import cache


@cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def release_free_memory() -> None:
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
