"""The cpu backend's block caches: allocation that costs nothing until used, writes to the right slots."""

import os

import pytest
import torch

from pagedllm.backends.cpu.layers.kv_cache import (BlockCache, ChannelQuantizedBlockCache, QuantizedBlockCache,
                                                   lazy_zeros, slot_rows, write_u8)
from pagedllm.backends.cpu.runner.kernels import load_kernels


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
    slots = torch.tensor([5 * block_size + 3, 0, 2 * block_size + 1])
    x = torch.randn(len(slots), heads, dim)
    if quantized:  # keys and values of one layer, values written as x
        keys, cache = ChannelQuantizedBlockCache(blocks, heads, block_size, dim), \
            QuantizedBlockCache(blocks, heads, block_size, dim)
        write_u8(keys, cache, torch.randn(len(slots), heads, dim), x, slots)
    else:
        cache = BlockCache(blocks, heads, block_size, dim, torch.float32)
        cache.write(x, slot_rows(slots, heads, block_size))
    got = cache.gather(torch.arange(blocks), 1, blocks, torch.float32)[0]  # [heads, blocks * block_size, dim]
    written = got.transpose(0, 1)[slots]
    torch.testing.assert_close(written, x, atol=0.02 if quantized else 0, rtol=0)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert got.transpose(0, 1)[untouched].abs().sum() == 0


def u8_layer(blocks: int, heads: int, block_size: int, dim: int):
    return ChannelQuantizedBlockCache(blocks, heads, block_size, dim), QuantizedBlockCache(blocks, heads, block_size,
                                                                                          dim)


@pytest.mark.cpu_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_u8_keys_keep_a_channel_range_per_block_that_grows_with_its_tokens(dtype):
    """A prompt chunk, then decodes one token at a time into the same blocks, some with keys outside the range so
    far: the C++ writer equals the torch one; a key quantized again as its block's range grew is within 1.5 steps of
    the final range (half a step each time), and keys are a quarter step off on average, as rounding once is."""
    kernels, _ = load_kernels("kernel")
    blocks, heads, block_size, dim = 5, 2, 16, 64
    torch.manual_seed(0)
    keys = torch.randn(40, heads, dim)
    keys[[20, 33], 0, 5] = torch.tensor([9.0, -7.0])  # outliers after the first tokens of their blocks
    values = torch.randn(40, heads, dim)
    table = torch.tensor([3, 0, 4])
    positions = torch.arange(40)
    slots = table[positions // block_size] * block_size + positions % block_size
    layers = [u8_layer(blocks, heads, block_size, dim) for _ in range(2)]
    for writer, layer in zip((kernels, None), layers):
        write_u8(*layer, keys[:18].to(dtype), values[:18].to(dtype), slots[:18], writer)  # a chunk over 2 blocks
        for t in range(18, 40):
            write_u8(*layer, keys[t:t + 1].to(dtype), values[t:t + 1].to(dtype), slots[t:t + 1], writer)
    (ck, cv), (tk, tv) = layers
    for a, b in ((ck.scale, tk.scale), (ck.minimum, tk.minimum), (cv.scale, tv.scale), (cv.minimum, tv.minimum)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in ((ck.data, tk.data), (cv.data, tv.data)):  # a rounding may land on the other side of a half
        assert (a.int() - b.int()).abs().max() <= 1 and (a != b).float().mean() < 1e-3
    got = ck.gather(table, 1, 3, torch.float32)[0].transpose(0, 1)[:40]  # [tokens, heads, dim]
    step = ck.scale[table].repeat_interleave(block_size, 0)[:40]  # [tokens, heads, dim]: its block's final step
    error = (got - keys.to(dtype).float()).abs() / step
    assert error.max() <= 1.5 and error.mean() < 0.27
