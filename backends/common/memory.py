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


MADV_DONTNEED = 4
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


def drop_mapped_pages(array) -> None:
    """Drop a read-only file mapping's pages under ``array`` (a numpy view into it) from this process's resident
    memory once it has been read: they stay in the page cache and fault back in from the file if read again."""
    if array.nbytes:
        madvise(array.ctypes.data, array.nbytes, MADV_DONTNEED)


def checkpoint_mappings(suffixes: tuple[str, ...] = (".safetensors",)) -> list[str]:
    """This process's mappings of checkpoint files that hold only the file's bytes, as /proc/self/maps names them:
    loaders map the files (transformers privately and writable), and parameters of the file's dtype stay views into
    them. A private mapping with a written page (counted as Anonymous) is left out: dropping would undo the write.
    Linux only (smaps walks the pages, so callers take this once and drop many times)."""
    try:
        with open("/proc/self/smaps", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    regions, current = [], None
    for line in lines:
        fields = line.split(maxsplit=5)
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: range, perms, offset, device, inode, path
            current = line if len(fields) == 6 and fields[5].endswith(suffixes) else None
        elif current is not None and fields[0] == "Anonymous:":
            if int(fields[1]) == 0:
                regions.append(current)
            current = None
    return regions


def in_mappings(tensor, regions: list[str]) -> bool:
    """Whether ``tensor``'s data lies in one of the mappings ``regions`` (from checkpoint_mappings): a view of a
    checkpoint file, resident only where it has been read."""
    address = tensor.data_ptr()
    return any(start <= address < end for start, end in map(_bounds, regions))


def _bounds(region: str) -> tuple[int, int]:
    """(start, end) addresses of a /proc/self/maps line."""
    start, end = (int(bound, 16) for bound in region.split(maxsplit=1)[0].split("-"))
    return start, end


def drop_checkpoint_pages(regions: list[str]) -> None:
    """Drop the resident pages of the checkpoint mappings ``regions`` (from checkpoint_mappings) that are still
    mapped as they were: a weight packed into a copy of its own, or one read only by rows (the embedding), would
    otherwise keep its whole file-backed size in the process's resident memory. Whatever still views them faults
    its pages back in from the file (the page cache) on use. A range unmapped since, and perhaps reused by other
    memory, is left alone: dropping anonymous pages would zero them."""
    if not regions:
        return
    with open("/proc/self/maps", encoding="utf-8") as f:
        mapped = set(f.read().splitlines())
    for line in regions:
        if line in mapped:
            start, end = _bounds(line)
            madvise(start, end - start, MADV_DONTNEED)


def blocks_to_commit(num_blocks: int, bytes_per_block: int) -> int:
    """How many of a new KV cache's blocks (the lowest ids) to commit at start-up: up to KV_COMMIT_BYTES."""
    return min(num_blocks, KV_COMMIT_BYTES // bytes_per_block)
