"""The process's memory allocator: say which one is in use, and stop glibc's from handing freed memory back.

A prefill step allocates and frees tensors of tens of MB by the hundred. glibc's malloc returns such blocks to the
kernel (mmap above its threshold, trimming of the heap top), so the next step faults every page in again, and
first-touch faults are dear in a VM. Keeping freed memory inside the process, as TCMalloc does, avoids that; the
price is a resident size that stays at the step's high-water mark, which a serving process reaches anyway.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import logging
import os
import platform

from pagedllm.backends.common.memory import tcmalloc_loaded

logger = logging.getLogger("pagedllm.cpu")

_SEARCH = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit: blocks below it come from the heap and are reused
TRIM_THRESHOLD = 1 << 30  # free memory at the heap top kept before any is returned
LOADING_MMAP_THRESHOLD = 1 << 20  # while loading: blocks from 1 MiB up mapped apart, unmapped as soon as freed


def _installed() -> str | None:
    for folder in _SEARCH:
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            matches = glob.glob(os.path.join(folder, name))
            if matches:
                return matches[0]
    found = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return found if found and os.path.isabs(found) else None


def tcmalloc_status() -> str:
    if tcmalloc_loaded():
        return "TCMalloc is preloaded"
    path = _installed()
    if path:
        return f"TCMalloc is installed but not preloaded; start with LD_PRELOAD={path} for faster allocation"
    return ("TCMalloc not in use (optional: apt-get install libtcmalloc-minimal4, then "
            "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4)")


def keep_freed_memory() -> str:
    """Tune glibc's malloc to keep freed blocks for reuse (once per process; TCMalloc needs nothing).
    Returns what was done, for the log."""
    if tcmalloc_loaded():
        return "allocator: TCMalloc (preloaded)"
    if platform.libc_ver()[0] != "glibc":
        return f"allocator: the C library's ({tcmalloc_status()})"
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return f"allocator: glibc malloc, untuned (mallopt refused) ({tcmalloc_status()})"
    return (f"allocator: glibc malloc keeping freed memory (mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim "
            f"threshold {TRIM_THRESHOLD >> 20} MiB); {tcmalloc_status()}")


def free_loading_buffers_at_once() -> None:
    """While the weights load: their buffers and temporaries (shards, fused copies, packing) go back to the kernel as
    they are freed, instead of piling up in the heap beside what is made of them (glibc's own threshold rises to
    32 MiB blocks after the first large free). keep_freed_memory tunes it for the steps afterwards."""
    if not tcmalloc_loaded() and platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD)


def return_loading_memory() -> None:
    """Hand the memory that loading freed (conversion buffers, dequantized tables) back to the kernel once: kept,
    it stays resident for good, since steps reuse only their own blocks (glibc; TCMalloc releases its own)."""
    if not tcmalloc_loaded() and platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)


@contextlib.contextmanager
def loading_weights():
    """Around a model's loading, in one process or a TP rank: large blocks mapped apart while the weights load, then
    what loading freed handed back and malloc tuned for the steps (logged)."""
    free_loading_buffers_at_once()
    yield
    return_loading_memory()
    logger.info("%s", keep_freed_memory())
