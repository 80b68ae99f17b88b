"""model/memory.py's `fix_mmap_threshold`: freed large blocks go back to the system.

glibc raises its mmap threshold to the size of a large block once that block is freed;
blocks under the new threshold then come from the heap, and freeing them keeps them
resident while a later block sits above them. Each case runs in a fresh process, so the
heap's state is its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import ctypes, os, sys
    from looprl.model.memory import fix_mmap_threshold
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    MB = 1 << 20
    page = os.sysconf("SC_PAGE_SIZE")
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page / MB
    fixed = sys.argv[1] == "fixed" and fix_mmap_threshold()
    big = libc.malloc(24 * MB)  # mapped; freeing it raises the threshold to 24 MB
    ctypes.memset(big, 1, 24 * MB)
    libc.free(big)
    blocks = [libc.malloc(8 * MB) for _ in range(10)]
    for block in blocks:
        ctypes.memset(block, 1, 8 * MB)
    before = rss()
    for block in blocks[:-1]:  # the last one stays: it holds the heap's top
        libc.free(block)
    print(fixed, before - rss())
    """
)


def released_mb(mode: str) -> tuple[bool, float]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True
    )
    fixed, mb = out.stdout.split()
    return fixed == "True", float(mb)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc on Linux")
def test_a_fixed_mmap_threshold_gives_freed_large_blocks_back():
    fixed, with_fix = released_mb("fixed")
    assert fixed  # mallopt took the setting
    _, without = released_mb("default")
    assert with_fix >= 64  # 9 blocks of 8 MB freed: ~72 MB back
    assert without < 16  # kept in the heap under the raised threshold
