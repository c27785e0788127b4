"""pagedllm.backends.common.memory.commit: pages backed before their first write, so a step does not pay for them."""

import ctypes
import mmap
import sys

import pytest

from pagedllm.backends.common.memory import PAGE, commit
from pagedllm.utils import cdiv

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


def resident_pages(address: int, nbytes: int) -> int:
    """How many pages of a page-aligned range are in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = cdiv(nbytes, PAGE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(address, nbytes, vec) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vec.raw[:pages])


def all_resident(address: int, nbytes: int) -> bool:
    """Whether every page holding a byte of [address, address + nbytes) is in memory."""
    start = address // PAGE * PAGE
    return resident_pages(start, address + nbytes - start) == cdiv(address + nbytes - start, PAGE)


def fresh_pages(count: int) -> tuple[mmap.mmap, int]:
    region = mmap.mmap(-1, count * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return region, ctypes.addressof(ctypes.c_char.from_buffer(region))


def skip_unless_commit_works() -> None:
    _, address = fresh_pages(1)
    if not commit(address, PAGE):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14 or newer")


def test_commit_backs_the_pages_of_a_range_and_no_others():
    skip_unless_commit_works()
    region, address = fresh_pages(64)
    assert resident_pages(address, 64 * PAGE) == 0
    assert commit(address + 100, 10 * PAGE)  # pages 0..10: the range starts inside page 0
    assert resident_pages(address, 11 * PAGE) == 11
    assert resident_pages(address + 11 * PAGE, 53 * PAGE) == 0
    assert region[:64 * PAGE] == bytes(64 * PAGE)  # still zeros
    assert not commit(address, 0)
