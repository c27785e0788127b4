"""The cpu backend's block caches: allocation that costs nothing until used, writes to the right slots."""

import os

import pytest
import torch

from pagedllm.backends.cpu.layers.kv_cache import BlockCache, QuantizedBlockCache, lazy_zeros, slot_rows


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_large_cache_takes_no_memory_until_written():
    before = _rss_bytes()
    cache = lazy_zeros((1 << 30,), torch.uint8)  # 1 GiB
    assert _rss_bytes() - before < 64 << 20
    assert cache[::1 << 20].sum() == 0  # reads zeros (touching one byte per MiB only)
    cache[:1 << 20] = 7
    assert int(cache[(1 << 20) - 1]) == 7 and int(cache[1 << 20]) == 0


@pytest.mark.parametrize("quantized", [False, True])
def test_writes_land_in_the_slots_of_the_block_table(quantized):
    blocks, heads, block_size, dim = 6, 2, 4, 8
    cache = (QuantizedBlockCache(blocks, heads, block_size, dim) if quantized
             else BlockCache(blocks, heads, block_size, dim, torch.float32))
    slots = torch.tensor([5 * block_size + 3, 0, 2 * block_size + 1])
    x = torch.randn(len(slots), heads, dim)
    cache.write(x, slot_rows(slots, heads, block_size))
    got = cache.gather(torch.arange(blocks), 1, blocks, torch.float32)[0]  # [heads, blocks * block_size, dim]
    written = got.transpose(0, 1)[slots]
    torch.testing.assert_close(written, x, atol=0.02 if quantized else 0, rtol=0)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert got.transpose(0, 1)[untouched].abs().sum() == 0
