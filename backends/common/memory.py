"""Memory helpers of the backends: backing pages before their first write (KV caches), madvise for memory that
Python does not own (huge pages for weights), and whether TCMalloc is the allocator."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys


def tcmalloc_loaded() -> bool:
    """Whether TCMalloc is this process's allocator (preloaded with LD_PRELOAD)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            return "tcmalloc" in f.read()
    except OSError:
        return "tcmalloc" in os.environ.get("LD_PRELOAD", "")


MADV_POPULATE_WRITE = 23  # Linux 5.14+
PAGE = mmap.PAGESIZE
#: How much of a new KV cache the backends commit at start-up, in the order the allocator hands out blocks.
KV_COMMIT_BYTES = 1 << 30


def madvise(address: int, nbytes: int, advice: int) -> int:
    """madvise(2) over the pages holding [address, address + nbytes), for memory Python's mmap objects do not own
    (numpy's, torch's, oneDNN's): 0, or the errno."""
    if not sys.platform.startswith("linux"):
        return errno.ENOSYS
    start = address // PAGE * PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return 0 if libc.madvise(start, address + nbytes - start, advice) == 0 else ctypes.get_errno()


def commit(address: int, nbytes: int) -> bool:
    """Back [address, address + nbytes) with memory now rather than on first write. In a VM the first write to a
    page can cost a host fault, and one paid inside a step stalls every thread at the next barrier. False where
    the kernel cannot (not Linux, or older than 5.14): the pages then come on first write, as before."""
    return nbytes > 0 and madvise(address, nbytes, MADV_POPULATE_WRITE) == 0


def blocks_to_commit(num_blocks: int, bytes_per_block: int) -> int:
    """How many of a new KV cache's blocks (the lowest ids) to commit at start-up: up to KV_COMMIT_BYTES."""
    return min(num_blocks, KV_COMMIT_BYTES // bytes_per_block)
