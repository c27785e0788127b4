"""The cpu backend's block caches: allocation that costs nothing until used, writes to the right slots."""

import os

import pytest
import torch

from pagedllm.backends.cpu.kv_cache import BlockCache, QuantizedBlockCache, ResidentFrontier, lazy_zeros, slot_rows


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


def test_the_resident_frontier_populates_ahead_of_the_blocks_written_a_chunk_at_a_time():
    mib = 1 << 20
    keys, values = (BlockCache(1024, 2, 8, 64, torch.float32) for _ in range(2))  # 4 KiB a block: 4 MiB each
    frontier = ResidentFrontier(keys.tensors + values.tensors, 1024, chunk_bytes=2 * mib)
    if frontier._madvise is None:
        pytest.skip("no madvise here")
    before = _rss_bytes()
    frontier.ensure(3)
    assert frontier.frontier == 256  # a chunk: 2 MiB over both caches
    assert 2 * mib <= _rss_bytes() - before < 6 * mib
    frontier.ensure(100)  # inside the frontier: nothing to do
    assert frontier.frontier == 256
    frontier.ensure(5000)  # beyond the pool: clipped
    assert frontier.frontier == 1024
    assert _rss_bytes() - before >= 8 * mib
    assert keys.data.abs().sum() == 0 and values.data.abs().sum() == 0  # resident pages read zeros


def test_without_madvise_the_frontier_leaves_pages_to_fault_in():
    cache = BlockCache(1024, 2, 8, 64, torch.float32)
    frontier = ResidentFrontier(cache.tensors, 1024)
    frontier._madvise = None
    before = _rss_bytes()
    frontier.ensure(1024)
    assert frontier.frontier == 0 and _rss_bytes() - before < 1 << 20
    cache.data[1023] = 1.0  # writes still work: the page faults in
    assert float(cache.data[1023].sum()) == 2 * 8 * 64


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
